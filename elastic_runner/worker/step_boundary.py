"""The step boundary the runtime owns: where every rank agrees to stop for a resize.

Why the runtime, not the script: a resize that waits for the script to call
`ckpt.due()` depends on one idiom; a script that saved on its own cadence kept
training for the whole --notice-deadline while the agent waited for a promise the
script never kept. Every rank passes `ElasticSampler`'s iteration once per step, so
the sampler calls `reached()` after each step's body, and the runtime acts there:

- Agreement: every rank contributes "my agent asked for a stop" (the notice file,
  contract.NOTICE_FILE) to a MAX all-reduce, so all ranks stop at the same step. The
  all-reduce runs on a gloo group of its own (no GPU sync for NCCL jobs, no
  interleaving with the script's collectives) and is pipelined: the result read at
  step s is the one started at step s-1, so it costs no wait, and a stop comes one
  step later than the request.
- Acting: rank 0's Checkpointers save the state registered with them for that step
  (`Checkpointer.save_for_resize`), every worker leaves the process group and exits
  with EXIT_FOR_RESIZE.
- Showing: the rank's progress file says it has a boundary (`boundary`), how fast it
  steps, and, once agreed, at which step it stops (`stopping`). The agent's drain
  (drain.py) waits on exactly that.

`due()`-driven scripts without a sampler use the blocking `agree_now()` instead.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from elastic_runner.contract import ProgressWriter, progress_file

log = logging.getLogger("elastic_runner.worker.runtime")


class StepBoundary:
    """One per worker process, held by its Context."""

    def __init__(self, rank: int, world_size: int, notice_path: str, progress_dir: str):
        self._rank = rank
        self._world_size = world_size
        self._notice_path = Path(notice_path) if notice_path else None
        self._writer = None
        if progress_dir:
            self._writer = ProgressWriter(progress_file(Path(progress_dir), rank))
        self.active = False  # a sampler has reached a boundary in this process
        self.due_driven = False  # Checkpointer.due() agrees on stops (no sampler)
        self.user_reports = False  # er.report() gives the numbers; we only add flags
        self._samples = 0
        self._group: Any = None
        self._pending: tuple[Any, Any] | None = None  # (work, tensor) started last step

    @property
    def enabled(self) -> bool:
        return self._notice_path is not None

    def asked(self) -> bool:
        return self._notice_path is not None and self._notice_path.exists()

    def reached(self, step: int, samples: int) -> bool:
        """After step `step`'s body; True when every rank agreed to stop here."""
        self.active = True
        self._samples += samples
        stop = self._agree_pipelined()
        if stop or not self.user_reports:
            self.write(step, None if self.user_reports else self._samples,
                       stopping=step if stop else None)
        return stop

    def write(self, step: int, samples: int | None, stopping: int | None = None) -> None:
        """Progress for the agent (metrics, drain); `samples` None keeps the last count."""
        if self._writer is None:
            return
        if samples is None:
            last = self._writer.last
            samples = int(last["samples"]) if last else 0
        self._writer.write(step, samples, boundary=self.active or self.due_driven,
                           stopping=stopping)

    def agree_now(self) -> bool:
        """Blocking agreement for `due()`-driven scripts (no sampler boundary)."""
        if self._world_size <= 1:
            return self.asked()
        work, flag = self._start()
        work.wait()
        return bool(flag.item())

    def _agree_pipelined(self) -> bool:
        if self._world_size <= 1:
            return self.asked()
        agreed = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = bool(flag.item())
        self._pending = None if agreed else self._start()
        return agreed

    def _start(self):
        import torch
        import torch.distributed as dist

        if self._group is None:
            # Every rank reaches its first boundary (or due()) at the same step, so
            # this collective group creation lines up across ranks.
            self._group = dist.new_group(backend="gloo")
        flag = torch.tensor([1 if self.asked() else 0], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return work, flag

    def close(self) -> None:
        """Finish the collective in flight before the process group goes away."""
        if self._pending is not None:
            work, _ = self._pending
            self._pending = None
            try:
                work.wait()
            except Exception as error:  # noqa: BLE001 - a dead peer must not block leaving
                log.debug("pending step-boundary agreement failed: %s", error)
