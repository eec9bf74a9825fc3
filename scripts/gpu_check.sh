#!/usr/bin/env bash
# One prepared check for a GPU machine (issue 15): elastic-run --standalone
# --nproc-per-node auto on scripts/gpu_check_worker.py. It checks NCCL
# initialisation, one in-process re-formation into a new NCCL communicator with
# every worker kept on its GPU, that a --prewarm waiting interpreter makes no CUDA
# context, and prints one PASS/FAIL line per check and the timings (NCCL init,
# steps, the re-formation pause). Whole run under 5 minutes.
#
#   bash scripts/gpu_check.sh            # needs .venv with a CUDA build of torch
#   bash scripts/gpu_check.sh --python python3   # an image's own CUDA torch instead;
#       the project's other dependencies must import there too, e.g. wheels put in
#       with `pip install --no-index --no-deps --target DIR` and PYTHONPATH=DIR:.
#       (never write a wrapper script to .venv/bin/python: in a venv it is a link
#       to the interpreter, and writing through it replaces the interpreter)
#
# Exit: 0 every check passed; 1 a check failed (or the run passed its time
# bound); 2 nothing to check here (no GPU visible, no .venv, no CUDA torch).
# Flags go to scripts/gpu_check.py (--help lists them).
set -uo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
if [ "${1:-}" = "--python" ]; then
  python="${2:?gpu_check: --python needs an interpreter}"
  shift 2
  if ! command -v "$python" >/dev/null; then
    echo "gpu_check: cannot run here: no interpreter $python" >&2
    exit 2
  fi
elif [ ! -x "$python" ]; then
  echo "gpu_check: cannot run here: no .venv (run scripts/setup.sh with a CUDA build of torch, or pass --python)" >&2
  exit 2
fi
# The job's own bound is 240 s; this one catches a hang before the job starts.
timeout -k 10 290 "$python" scripts/gpu_check.py "$@"
code=$?
if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
  echo "gpu_check: FAIL: the check did not finish within 290 s" >&2
  exit 1
fi
exit "$code"
