"""A training script for the checkpoint-trust tests (issue 12), run under elastic-run
or on its own (one process, no process group).

Every step all-reduces a counter, so ranks advance together; rank 0 checkpoints
every --every steps. Faults it can carry:
  --disk-full-from S   a storage fake: every write under a step directory >= S
                       fails half-way with ENOSPC, like a disk that filled up;
  --pause-at S         in the first run only, rank 0 stops after step S, writes its
                       pid to --pause-file and waits to be killed (the test corrupts a
                       checkpoint meanwhile).
--exit picks how the script ends: `with` er.init(), an explicit er.finish(), or
`return` without either.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import elastic_runner as er  # noqa: E402
from elastic_runner.worker.checkpoint import storage as checkpoint_storage  # noqa: E402


def fill_disk_from(first_step: int) -> None:
    original = checkpoint_storage._write_all

    def write(fileobj, data) -> None:
        found = re.search(r"step-(\d+)", str(fileobj.name))
        if found and int(found.group(1)) >= first_step:
            fileobj.write(memoryview(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        original(fileobj, data)

    checkpoint_storage._write_all = write


def pause_to_be_killed(pause_file: Path) -> None:
    pause_file.write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.1)
    raise SystemExit("nobody killed the paused worker")


def train(ctx, args) -> None:
    ckpt = er.Checkpointer(args.ckpt, keep=args.keep, every=args.every,
                           async_save=args.async_save)
    state = ckpt.load_latest() or {"step": 0, "w": torch.zeros(64)}
    first_run = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    trace = open(args.trace, "a", buffering=1) if args.trace else None
    for step in range(state["step"] + 1, args.steps + 1):
        total = torch.ones(1)
        if dist.is_initialized():
            dist.all_reduce(total)
        # A redone step differs from the first try (as with another world size or
        # non-deterministic kernels), so its checkpoint bytes differ too.
        state = {"step": step, "w": state["w"] + total, "round": ctx.round}
        if trace:
            trace.write(json.dumps({"step": step, "rank": ctx.rank, "round": ctx.round,
                                    "first_run": first_run,
                                    "etcd_client": "pyetcd" in sys.modules}) + "\n")
        if ckpt.due(step):
            ckpt.save(step, state)
        if step == args.pause_at and first_run and ctx.rank == 0:
            ckpt.wait()
            pause_to_be_killed(Path(args.pause_file))
        time.sleep(args.step_time)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--exit", choices=("with", "finish", "return"), default="with")
    parser.add_argument("--disk-full-from", type=int)
    parser.add_argument("--pause-at", type=int, default=-1)
    parser.add_argument("--pause-file")
    parser.add_argument("--trace")
    parser.add_argument("--step-time", type=float, default=0.0)
    args = parser.parse_args()
    if args.disk_full_from is not None:
        fill_disk_from(args.disk_full_from)
    if args.exit == "with":
        with er.init() as ctx:
            train(ctx, args)
    else:
        ctx = er.init()
        train(ctx, args)
        if args.exit == "finish":
            er.finish()


if __name__ == "__main__":
    main()
