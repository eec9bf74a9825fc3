"""The worker's side of the e2e harness's exact fault, `Job.fail_worker(rank, step)`.

Why a file per fault: the harness arms a fault before or while the job runs, and a
training script only has to ask at each step whether one is armed for it. The
worker of global rank R that reaches step S claims `rank{R}-step{S}` by renaming it
(atomic: only one process can), so the fault fires exactly once even though the
restarted round re-does step S; then it exits at once with the code the file holds.
The folder comes from $E2E_FAULT_DIR, which the harness puts in every agent's
environment (agents pass it on to their workers).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

FAULT_DIR_VARIABLE = "E2E_FAULT_DIR"
FIRED = ".fired"


def armed_path(folder: Path, rank: int, step: int) -> Path:
    return folder / f"rank{rank}-step{step}"


def fail_if_armed(rank: int, step: int) -> None:
    """Exit (no clean-up, like a crash) if a fault is armed for this rank and step."""
    folder = os.environ.get(FAULT_DIR_VARIABLE)
    if not folder:
        return
    armed = armed_path(Path(folder), rank, step)
    fired = armed.with_name(armed.name + FIRED)
    try:
        os.rename(armed, fired)
    except FileNotFoundError:
        return
    code = int(fired.read_text())
    print(f"injected failure: rank {rank} exits with code {code} at step {step}",
          file=sys.stderr, flush=True)
    os._exit(code)
