"""Save one checkpoint and freeze half-way through writing state.pt.

Run by tests/unit/test_checkpoint.py, which SIGKILLs this process once the
ready file exists: that is a deterministic "machine died mid-write".

Usage: ckpt_writer.py ROOT STEP READY_FILE
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from elastic_runner.worker.checkpoint import checkpointer as checkpoint, storage as checkpoint_storage  # noqa: E402


def main() -> None:
    root, step, ready = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])

    def half_then_hang(fileobj, data) -> None:
        view = memoryview(data)
        fileobj.write(view[: len(view) // 2])
        fileobj.flush()
        os.fsync(fileobj.fileno())
        ready.write_text("half written\n")
        time.sleep(600)

    checkpoint_storage._write_all = half_then_hang
    ckpt = checkpoint.Checkpointer(root, rank=0)
    ckpt.save(step, {"step": step, "w": torch.ones(1 << 20)})


if __name__ == "__main__":
    main()
