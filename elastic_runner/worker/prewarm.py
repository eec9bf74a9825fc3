"""A worker interpreter started ahead of time with torch imported (`--prewarm`).

Why: every start on the restart path is a fresh Python that imports torch before the
script runs its first line: 0.9-1.5 s on this machine, seconds more on a GPU node
whose site-packages sit on a network file system. With --prewarm the agent keeps one
such interpreter per local worker waiting (agent/prewarm.py); when the next round
needs a worker, it sends this process the script's command line and environment on
stdin, and the script starts with `import torch` already done. The process it runs
in is the worker: same pid, same pipes, same session, the same parent-death signal.

What is imported: torch, and torch._dynamo. The second because almost every training
script pays for it too, at its first optimizer: torch.optim wraps its methods with
`torch._compile._disable_dynamo`, which imports torch._dynamo at the first call
(0.8-0.9 s here, as long again as `import torch`; +70 MB per waiting interpreter). A
torch whose torch._dynamo does not import is left with torch alone: the script meets
the same error itself only if it needs it.

What differs from `python -u script.py`: those were imported before the script's first
line, with the environment the worker would have had minus its place in the round
(rank, world size, master address: nothing torch reads at import). A script that sets
a variable they read *at import* before its own `import torch` (TORCH_LOGS,
TORCHDYNAMO_* and TORCHINDUCTOR_* settings) no longer has that effect; variables read
later (CUDA_VISIBLE_DEVICES before the first CUDA call, OMP_NUM_THREADS, NCCL_*) behave
as before. That is why --prewarm is a choice, off by default. Tracebacks show this
module's and runpy's frames above the script's.

The order is one JSON line: {"argv": [...], "env": {...}}; argv is what would follow
`python -u` (a script path and its arguments, or "-m", a module and its arguments).
End of input without an order (the agent let this interpreter go) exits 0 at once.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys


def main() -> None:
    importlib.import_module("torch")  # the reason this process exists
    try:
        importlib.import_module("torch._dynamo")
    except Exception:  # noqa: BLE001 - an extra; the script meets it again if it needs it
        pass

    line = sys.stdin.buffer.readline()
    if not line.strip():
        return
    order = json.loads(line)
    os.environ.clear()
    os.environ.update(order["env"])
    _stdin_from_devnull()
    run(list(order["argv"]))


def _stdin_from_devnull() -> None:
    """As the agent starts a worker: stdin is /dev/null once the order is read."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def run(argv: list[str]) -> None:
    """Run the entry point as `python -u ARGV...` would, in this process."""
    if argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # what python does for a script
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
