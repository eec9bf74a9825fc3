#!/usr/bin/env bash
# Creates .venv and installs elastic-runner with its test and etcd extras.
# Idempotent: re-runs pip only when pyproject.toml changed. torch is pinned to the
# CPU build 2.13.0 here; an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.elastic-runner-installed
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q "torch==2.13.0" numpy -e ".[test]"
  echo "$want" > "$stamp"
fi
