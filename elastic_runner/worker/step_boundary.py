"""The step boundary the runtime owns: where every rank agrees to stop for a resize.

Why the runtime, not the script: a resize that waits for the script to call
`ckpt.due()` depends on one idiom; a script that saved on its own cadence kept
training for the whole --notice-deadline while the agent waited for a promise the
script never kept. Every rank passes `ElasticSampler`'s iteration once per step, so
the sampler calls `reached()` after each step's body, and the runtime acts there:

- Agreement: every rank contributes "my agent asked for a stop" (the notice file,
  contract.NOTICE_FILE: 2) and, under `@er.elastic`, "my agent asked for a pause"
  (reform.py's pause request for the current round: 1) to a MAX all-reduce, so all
  ranks stop at the same step; the same all-reduce carries the negated notice flag,
  so every rank also learns whether *every* rank has a notice (then nobody keeps
  the state, and even `@er.elastic` ranks save it as on the restart path). The
  all-reduce runs on a gloo group of its own (no GPU sync for NCCL jobs, no
  interleaving with the script's collectives) and is pipelined: the result read at
  step s is the one started at step s-1, so it costs no wait, and a stop comes one
  step later than the request.
- Acting: rank 0's Checkpointers save the state registered with them for that step
  (`Checkpointer.save_for_resize`), every worker leaves the process group and exits
  with EXIT_FOR_RESIZE. Under `@er.elastic` (`Agreement.in_place`) nothing is saved:
  ranks whose own node has the notice exit with EXIT_FOR_RESIZE, the state being
  replicated on the others, and every other rank raises `ReformRequested` out of
  the sampler's loop for `er.elastic` to re-form the group (elastic.py).
- Showing: the rank's progress file says it has a boundary (`boundary`), how fast it
  steps, and, once agreed, at which step it stops (`stopping`). The agent's drain
  (drain.py) waits on exactly that.

`due()`-driven scripts without a sampler use the blocking `agree_now()` instead.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from elastic_runner.contract import ProgressWriter, progress_file
from elastic_runner.worker.abort import group_sockets

log = logging.getLogger("elastic_runner.worker.runtime")

PAUSE, NOTICE = 1, 2  # what a rank contributes; the MAX wins


class ReformRequested(BaseException):
    """Internal: every rank agreed at the boundary of `step` to re-form in place.

    Raised out of ElasticSampler's iteration (through the script's loop) and caught
    by `er.elastic`; never seen by a script that does not use it. A BaseException,
    like KeyboardInterrupt, so that a script's `except Exception` cannot swallow it.
    """

    def __init__(self, step: int):
        super().__init__(f"every rank agreed to re-form after step {step}")
        self.step = step


@dataclass(frozen=True)
class Agreement:
    """What every rank agreed at one step boundary."""

    value: int = 0  # 0: go on; PAUSE: a pause was asked somewhere; NOTICE: a notice
    every_rank_noticed: bool = False  # nobody stays: the state must be saved
    noticed_here: bool = False  # this rank contributed a notice (its node leaves)
    in_place: bool = False  # under er.elastic, and some rank keeps the state

    def __bool__(self) -> bool:
        return self.value > 0


class StepBoundary:
    """One per worker process, held by its Context."""

    def __init__(self, rank: int, world_size: int, notice_path: str, progress_dir: str):
        self._rank = rank
        self._world_size = world_size
        self._notice_path = Path(notice_path) if notice_path else None
        self._writer = None
        if progress_dir:
            self._writer = ProgressWriter(progress_file(Path(progress_dir), rank))
        self.active = False  # a sampler's loop reports this round's step boundaries
        self.sampler: Any = None  # the ElasticSampler whose loop that is
        self.due_driven = False  # Checkpointer.due() agrees on stops (no sampler)
        self.user_reports = False  # er.report() gives the numbers; we only add flags
        self._samples = 0
        self._group: Any = None
        self._pending: tuple[Any, Any, bool] | None = None  # (work, tensor, noticed) of last step
        # Set by er.elastic (elastic.py): is a pause asked for this round, and the hook
        # told of every completed step (State.commit) before the agreement is read.
        self.pause_asked: Callable[[], bool] | None = None
        self.on_completed: Callable[[int], None] | None = None
        self.agreed = Agreement()

    @property
    def enabled(self) -> bool:
        return self._notice_path is not None or self.pause_asked is not None

    @property
    def in_place(self) -> bool:
        """Under er.elastic: this round ends in a re-formation in this process."""
        return self.pause_asked is not None

    def asked(self) -> bool:
        return self._notice_path is not None and self._notice_path.exists()

    def reached(self, step: int, samples: int) -> Agreement:
        """After step `step`'s body; true when every rank agreed to stop here
        (`self.agreed` keeps it: how, and whether in place)."""
        self.active = True
        self._samples += samples
        if self.on_completed is not None:
            self.on_completed(step)  # before the agreement: a failed wait must not undo it
        self.agreed = stop = self._agree_pipelined()
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
        """Blocking agreement for `due()`-driven scripts (no sampler boundary).

        Only notices count here: pausing in place needs the sampler's boundary."""
        if self._world_size <= 1:
            return self.asked()
        work, flag, noticed = self._start(pause=False)
        work.wait()
        return bool(self._agreement(flag.tolist(), noticed))

    def _agree_pipelined(self) -> Agreement:
        if self._world_size <= 1:
            value, noticed = self._contribution(pause=True)
            return self._agreement([value, -int(noticed)], noticed)
        agreed = Agreement()
        if self._pending is not None:
            work, flag, noticed = self._pending
            self._pending = None
            work.wait()
            agreed = self._agreement(flag.tolist(), noticed)
        if not agreed:
            self._pending = self._start(pause=True)
        return agreed

    def _contribution(self, pause: bool) -> tuple[int, bool]:
        noticed = self.asked()
        paused = pause and self.pause_asked is not None and self.pause_asked()
        return (NOTICE if noticed else PAUSE if paused else 0), noticed

    def _agreement(self, reduced, noticed: bool) -> Agreement:
        """`reduced`: [MAX of contributions, MAX of negated notices]; `noticed`: ours,
        as contributed (a notice file appearing since must not change our part)."""
        value, every_noticed = int(reduced[0]), int(reduced[1]) == -1
        return Agreement(value, every_noticed, noticed,
                         in_place=value > 0 and self.in_place and not every_noticed)

    def _start(self, pause: bool):
        import torch
        import torch.distributed as dist

        if self._group is None:
            # Every rank reaches its first boundary (or due()) at the same step, so
            # this collective group creation lines up across ranks.
            with group_sockets.capture():
                self._group = dist.new_group(backend="gloo", timeout=default_group_timeout())
        value, noticed = self._contribution(pause)
        flag = torch.tensor([value, -int(noticed)], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return work, flag, noticed

    def close(self) -> None:
        """Finish the collective in flight before the process group goes away, and let
        go of this boundary's group, so that destroy_process_group() frees it: its
        gloo threads are joined then, not in the interpreter's finalization."""
        if self._pending is not None:
            work, flag, _ = self._pending
            self._pending = None
            outlive_the_interpreter(flag)
            try:
                work.wait()
            except Exception as error:  # noqa: BLE001 - a dead peer must not block leaving
                log.debug("pending step-boundary agreement failed: %s", error)
        self._group = None

    def abandon(self) -> None:
        """The process group failed under us (er.elastic re-forms it): drop the
        agreement in flight unread, and the group with it. Waiting here could block
        on a frozen peer; destroy_process_group still waits for it, but no longer
        than the job's collective timeout (default_group_timeout)."""
        if self._pending is not None:
            outlive_the_interpreter(self._pending[1])
        self._pending = None
        self._group = None


def outlive_the_interpreter(tensor: Any) -> None:
    """Keep one reference to a tensor of a collective this process may exit right after.

    Why: work.wait() returns before gloo's worker thread lets go of the work, and with
    it the tensor. If that comes after the interpreter began finalizing, the thread
    drops the last reference to a tensor that has a Python object, must take the GIL
    for it, and is ended by std::terminate instead: "terminate called without an
    active exception", SIGABRT after a clean last step, which the agent counts as a
    failure. A core dump here showed ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork
    -> TensorImpl::decref_pyobject -> take_gil -> pthread_exit while Py_FinalizeEx ran
    its collection (torch 2.13; pytorch/pytorch#179291 describes the same). With a
    reference never released, the thread's release is never the last. One 8-byte
    tensor per process, at its end or after an abandoned round."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(tensor))


def default_group_timeout() -> datetime.timedelta | None:
    """The default group's collective timeout, for the groups the runtime makes (the
    boundary's own, State.sync's transfer group).

    Why: new_group() without a timeout takes torch's default for gloo, 30 minutes
    (distributed_c10d._get_default_timeout), not the default group's. When a peer
    froze (SIGSTOP: sockets open, no answer), the agreement in flight on the
    boundary group never failed, and destroy_process_group(), whose gloo shutdown
    waits for queued work, held an er.elastic survivor for that long after its
    training collective had timed out: it never paused, and its agent fell back to
    restarting it. None (torch's default) where the group's backend does not say.
    """
    import torch
    import torch.distributed as dist

    try:
        group = dist.distributed_c10d._get_default_group()
        device = torch.device(group._device_types[0])  # NCCL: cuda; gloo: cpu
        return group._get_backend(device).options._timeout
    except (RuntimeError, ValueError, AttributeError, IndexError) as error:
        log.debug("the default group's timeout is unreadable: %s", error)
        return None
