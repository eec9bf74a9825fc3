"""examples/train_fsdp.py with two test-only additions, for tests/e2e/test_fsdp.py.

Why a wrapper instead of flags in the example: what it adds reaches into the
checkpoint code's internals, which a user's script must never do.

- A rank killed mid-save: the harness's `Job.fail_worker(rank, step)` fires here
  inside the sharded save of `step`, when rank `rank` starts to hash the shards it
  has just written (sharded_files.hash_files: DCP's shards and .metadata are on disk,
  MANIFEST.json is not, and rank 0 waits for this rank's hashes). The process ends at
  once (os._exit), as a SIGKILL would leave it: an incomplete checkpoint, exactly.
- What the restore found: before the example starts, rank 0 appends one trace line
  {"kind": "start", "checkpoints": {"step-NNNNNNNN": has a MANIFEST.json}} listing the
  checkpoint folder, so the test can see an incomplete checkpoint that was present
  (and not loaded) when the next round restored.

    elastic-run ... tests/helpers/fsdp_worker.py <train_fsdp.py's flags>
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]

import train_fsdp  # noqa: E402

from elastic_runner.worker.checkpoint import sharded_files  # noqa: E402
from tests.helpers.injected_fault import fail_if_armed  # noqa: E402


def fail_mid_save() -> None:
    """Route every shard hash through the armed-fault check (module docstring)."""
    original = sharded_files.hash_files

    def hash_files(storage, directory, written, rank):
        fail_if_armed(rank, int(re.search(r"step-(\d+)", str(directory)).group(1)))
        return original(storage, directory, written, rank)

    sharded_files.hash_files = hash_files


def record_checkpoints(args) -> None:
    """Rank 0: which step folders exist now, and which of them committed."""
    if os.environ.get("RANK") != "0" or not args.trace:
        return
    root = Path(args.checkpoint_dir)
    found = {p.name: (p / "MANIFEST.json").exists()
             for p in sorted(root.glob("step-*"))} if root.is_dir() else {}
    with open(args.trace, "a") as trace:
        trace.write(json.dumps({"kind": "start", "rank": 0, "t": time.time(),
                                "round": int(os.environ.get("ELASTIC_RUN_ROUND", -1)),
                                "checkpoints": found}) + "\n")


if __name__ == "__main__":
    fail_mid_save()
    record_checkpoints(train_fsdp.parse_args())
    train_fsdp.main()
