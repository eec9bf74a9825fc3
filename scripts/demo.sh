#!/usr/bin/env bash
# Sets up .venv, then trains examples/train_mlp.py on an embedded etcd with 2
# simulated nodes on this machine, adds a third, kills one, and prints the
# rescales the job survived.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/rescale_demo.py "$@"
