"""The worker side: what a training script calls under elastic-run.

`init()` is the worker's entry point, so it is the one place on this side that
reads the environment the agent set (torchrun's variables plus ELASTIC_RUN_*);
everything else receives the resulting `Context`.

Resizes: when a node joins or gets a spot notice, every agent creates the notice
file of its workers (a file, not a signal: a script that never called init() must
not be killed by an unexpected SIGUSR1). The runtime owns the step boundary
(step_boundary.py): ElasticSampler reports the end of every step, every rank agrees
there whether to stop, rank 0 saves the state registered with its Checkpointers
for that step, and every worker exits with EXIT_FOR_RESIZE, which the agents read
as "membership is changing", not as a failure. Zero steps are lost when the state
is registered: objects (not their state_dict()) given to save()/restore(), or
`register()`. Scripts without a sampler get the same through `Checkpointer.due()`.

Leaving: every way a script can end waits for every pending save of every
Checkpointer made under the context (they are tied to it, like the process
group): `with er.init()` and `er.finish()` close them before leaving the process
group and raise the first failure, which the worker's excepthook prints as one
line (exit 1); a script that just returns is covered by each async Checkpointer's
own atexit handler (checkpoint_async). A worker therefore never exits 0 with a
save pending or failed. After finish() the Checkpointers are closed: they still
load, but no longer save.

The etcd password reaches workers as the path of a 0600 file the agent writes
(ELASTIC_RUN_ETCD_PASSWORD_FILE), never as a variable value: the environment of
a process is readable by its user's other processes and ends up in crash dumps.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from elastic_runner.errors import StaleWriterError
from elastic_runner.worker.checkpoint import checkpointer as _checkpoint
from elastic_runner.worker.checkpoint.background import BackgroundWriter
from elastic_runner.worker.checkpoint.etcd_store import EtcdLatestStore
from elastic_runner.worker.checkpoint.objects import holds_objects, state_of
from elastic_runner.contract import CHECKPOINT_RECORD, EXIT_FOR_RESIZE, ProgressWriter, WorkerEnv
from elastic_runner.files import write_atomic
from elastic_runner.reform import STANDBY_ROUND
from elastic_runner.worker import formation
from elastic_runner.worker.abort import survive_nccl_errors
from elastic_runner.worker.step_boundary import ReformRequested, StepBoundary

log = logging.getLogger("elastic_runner.worker.runtime")

DEFAULT_TIMEOUT_S = 60.0  # forming the process group, and each collective in it

__all__ = ["Checkpointer", "Context", "EXIT_FOR_RESIZE", "EtcdLatestStore", "current",
           "finish", "init", "report"]


@dataclass(frozen=True)
class Context:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    restart_count: int
    round: int
    run_id: str
    backend: str
    device: str
    etcd_endpoints: tuple[str, ...] = ()
    etcd_prefix: str = ""
    etcd_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    notice_path: str = ""
    events_path: str = ""
    progress_dir: str = ""
    # The Checkpointers made under this context; finish() waits for and closes them.
    checkpointers: list = field(default_factory=list, init=False, compare=False, repr=False)
    boundary: StepBoundary = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "boundary", StepBoundary(
            self.rank, self.world_size, self.notice_path, self.progress_dir))

    def move(self, rank: int, world_size: int, local_world_size: int, restart_count: int,
             round_number: int) -> None:
        """In-process re-formation (elastic.py): this process holds another place in a
        new round. The one change a Context allows, made in place so that every holder
        (the script's `ctx`, the Checkpointers) sees it; the step boundary starts afresh
        (its progress file is named by the rank, its group is the round's)."""
        for name, value in (("rank", rank), ("world_size", world_size),
                            ("local_world_size", local_world_size),
                            ("restart_count", restart_count), ("round", round_number)):
            object.__setattr__(self, name, value)
        self.boundary.close()
        self.__post_init__()
        for checkpointer in self.checkpointers:
            checkpointer.rebind()

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, kind, error, trace) -> None:
        """A failed save fails the worker, unless the block already fails it: then
        the block's error is the one reported and the save's is logged."""
        if kind is None or (kind is SystemExit and error.code in (None, 0)):
            finish()
            return
        try:
            finish()
        except Exception as save_error:
            log.error("%s", save_error)


_active: list[Context] = []  # the process's one context, like torch's default group


def context_from_env(environ: Mapping[str, str], backend: str, device: str) -> Context:
    """The agent's WorkerEnv (contract.py) as this process's Context."""
    job = WorkerEnv.from_env(environ)
    return Context(
        rank=job.rank, local_rank=job.local_rank, world_size=job.world_size,
        local_world_size=job.local_world_size, restart_count=job.restart_count,
        round=job.round, run_id=job.run_id, backend=backend, device=device,
        etcd_endpoints=job.etcd_endpoints, etcd_prefix=job.etcd_prefix,
        etcd_options=_etcd_options(job), notice_path=job.notice_path,
        events_path=job.events_path, progress_dir=job.progress_dir)


def _etcd_options(job: WorkerEnv) -> dict[str, str]:
    """TLS files and user as given; the password from the agent's 0600 file. An
    unreadable file leaves the password out: etcd then says what is wrong."""
    options = job.etcd_options
    password_file = job.etcd_password_file
    if password_file:
        try:
            options["password"] = Path(password_file).read_text().rstrip("\r\n")
        except OSError as exc:
            log.warning("cannot read the etcd password file %s (%s): connecting without "
                        "a password", password_file, exc.strerror or exc)
    return options


def init(backend: str | None = None, timeout_s: float | None = None) -> Context:
    """Join the process group the launcher prepared; bind this worker's GPU.

    The agent shows each worker only its own GPU (CUDA_VISIBLE_DEVICES), so the
    device is cuda:0 whenever exactly one is visible, else cuda:LOCAL_RANK.
    `timeout_s` bounds forming the group and every collective in it; by default the
    launcher's ELASTIC_RUN_COLLECTIVE_TIMEOUT (a silent peer is given up on in time
    to re-form), else DEFAULT_TIMEOUT_S.
    """
    import torch
    import torch.distributed as dist

    environ = dict(os.environ)
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    device = "cpu"
    if cuda:
        index = 0 if torch.cuda.device_count() == 1 else int(environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        device = f"cuda:{index}"
    context = context_from_env(environ, backend, device)
    job = WorkerEnv.from_env(environ)
    if timeout_s is None:
        timeout_s = group_timeout_s(job)
    if "nccl" in backend and job.reform_dir:
        survive_nccl_errors()
    if dist.is_initialized():
        _warn_on_hand_typed_ranks(dist.get_rank(), dist.get_world_size(), context)
    elif context.world_size > 1 or "MASTER_ADDR" in environ:
        formation.form_first_group(backend, timeout_s, context.round, context.rank,
                                   context.world_size, environ,
                                   under_elastic_run=bool(job.reform_dir))
    _active[:] = [context]
    _report_our_errors_in_one_line()
    if context.round == STANDBY_ROUND:
        log.info("local rank %d on %s: standby, no place in the run yet (er.elastic waits "
                 "for one)", context.local_rank, device)
    else:
        log.info("rank %d/%d (local %d) on %s, round %d, restarts %d", context.rank,
                 context.world_size, context.local_rank, device, context.round,
                 context.restart_count)
    return context


def group_timeout_s(job: WorkerEnv) -> float:
    """The process group's timeout: the launcher's collective timeout when it set one."""
    return float(job.collective_timeout_s) if job.collective_timeout_s > 0 else DEFAULT_TIMEOUT_S


def _report_our_errors_in_one_line() -> None:
    """An elastic-runner error in a worker (bad checkpoint dir, stale writer) is a
    message for the user, not a traceback: print it as one line, exit 1."""
    from elastic_runner.errors import ElasticRunError

    previous = sys.excepthook

    def hook(kind, error, trace):
        if isinstance(error, ElasticRunError):
            print(f"elastic-run worker: error: {error}", file=sys.stderr, flush=True)
        else:
            previous(kind, error, trace)

    sys.excepthook = hook


def _warn_on_hand_typed_ranks(rank: int, world_size: int, context: Context) -> None:
    """The script built its own process group: say so when it disagrees with the plan."""
    if (rank, world_size) != (context.rank, context.world_size):
        log.warning("the process group was initialised by hand as rank %d of %d, but the "
                    "launcher assigned rank %d of %d: drop the hand-typed rank/world_size and "
                    "call er.init() (or init_process_group() with no rank)", rank, world_size,
                    context.rank, context.world_size)


def finish() -> None:
    """Wait for every pending save, then leave the process group cleanly so peers
    don't see a crash.

    Raises:
        CheckpointError: a save of this process failed (the first one; the others
            are logged). The group is left and the context cleared first.
    """
    import torch.distributed as dist

    context = current()
    failure = _close_checkpointers(context) if context is not None else None
    if context is not None:
        context.boundary.close()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _active.clear()
    if failure is not None:
        raise failure


def _close_checkpointers(context: Context) -> Exception | None:
    failure = None
    while context.checkpointers:
        try:
            context.checkpointers.pop(0).close()
        except Exception as error:  # noqa: BLE001 - every one must be closed
            if failure is None:
                failure = error
            else:
                log.error("another checkpoint save failed too: %s", error)
    return failure


def current() -> Context | None:
    return _active[0] if _active else None


def at_step_boundary(step: int, samples: int) -> None:
    """ElasticSampler calls this after the body of every step; see step_boundary.py.

    A no-op outside elastic-run. When the job agreed to stop here, rank 0 saves the
    registered state of this step, and the worker leaves with EXIT_FOR_RESIZE; under
    er.elastic the ranks that stay re-form in place instead (ReformRequested), and
    those of a leaving node exit without saving.
    """
    context = current()
    if context is None or not context.boundary.enabled:
        return
    agreed = context.boundary.reached(step, samples)
    if agreed.in_place and not agreed.noticed_here:
        raise ReformRequested(step)  # er.elastic re-forms the group (elastic.py)
    if agreed:
        stop_for_resize(context, step, save=not agreed.in_place)


def stop_for_resize(context: Context, step: int, save: bool = True) -> None:
    """Save the agreed step (rank 0), leave the group, exit for the agents to re-form.

    A due()-driven script that saves finished state dicts has registered nothing the
    runtime could save, but it will save at its next due(): that returns True, and
    its save() ends the worker. Every rank decides this alike (the same script).
    `save` False (er.elastic, this node leaves): the ranks that stay keep the state.
    """
    if not save:
        log.warning("resize: this node leaves after step %d; the ranks that stay keep "
                    "the state (no checkpoint)", step)
        finish()
        raise SystemExit(EXIT_FOR_RESIZE)
    checkpointers = list(context.checkpointers)
    if checkpointers and all(c.defers_to_due() for c in checkpointers):
        for checkpointer in checkpointers:
            checkpointer.stop_at_next_save()
        return
    saved = [c.save_for_resize(step) for c in checkpointers]
    what = ("checkpoint of step %d written" % step if any(saved)
            else "no state registered to save, resuming from the last checkpoint")
    if context.rank == 0:
        log.warning("resize: every rank stopped after step %d (%s)", step, what)
    finish()
    raise SystemExit(EXIT_FOR_RESIZE)


def _write_checkpoint_progress(folder: str, step: int, url: str, duration_s: float) -> None:
    """The agent's metrics read this for checkpoint age and save time (rank 0's node)."""
    record = {"step": step, "url": url, "time": time.time(), "duration_s": duration_s}
    try:
        # Not durable: a metrics input, rewritten after every save.
        write_atomic(os.path.join(folder, CHECKPOINT_RECORD), json.dumps(record).encode(),
                     durable=False)
    except OSError as exc:
        log.debug("checkpoint progress not written: %s", exc)


class Checkpointer(_checkpoint.Checkpointer):
    """A Checkpointer that knows the job: etcd record, resizes, registered state.

    State for a resize: the runtime saves, at the step every rank agreed to stop,
    whatever was registered: the objects passed to `save(step, objects)` or
    `restore(objects)` (anything with state_dict()), or `register(...)`. A script that
    only ever passes finished state dicts gives the runtime nothing current to save;
    it resumes from its last checkpoint and says so once.
    """

    def __init__(self, url_or_path, keep: int | None = 3, every: int | None = None,
                 async_save: bool = False, rank: int | None = None, latest_store=None, **kwargs):
        context = current()
        if rank is None and context is not None and context.round == STANDBY_ROUND:
            rank = -1  # standby (reform.py): only a reader until rebind() gives it a place
        # The record we open ourselves is fenced by the round: rebind() reopens it.
        self._own_store = latest_store is None and context is not None and bool(
            context.etcd_endpoints)
        if self._own_store:
            latest_store = _etcd_store(context)
        super().__init__(url_or_path, keep=keep, every=every, async_save=async_save, rank=rank,
                         latest_store=latest_store, **kwargs)
        self._context = context
        self._stopping = False
        self._registered: Any = None
        self._last_saved: int | None = None
        self._asks_due = False
        if context is not None:
            context.checkpointers.append(self)
        self._events = _event_log(context)

    def rebind(self) -> None:
        """The job re-formed in place (Context.move): same process, new rank, world
        size and round. A save in flight ends first, as the old round's (its record
        may be refused now that the new round has a plan: the state stays in memory,
        so that is a warning); the new rank 0 probes the root and writes from now on."""
        try:
            self.wait()
        except StaleWriterError as error:
            log.warning("%s (training goes on from the state in memory)", error)
        context = self._context
        self.rank, self._world_size = context.rank, context.world_size
        if self._sharded is not None:
            self._sharded.rebind()
        if (self.rank == 0 or self._sharded is not None) and not self._closed:
            self._storage.probe()
            if self.config.async_save and self._writer is None:
                self._writer = BackgroundWriter(self._exit_line)
        if self._own_store:
            self._latest.close()
            self._latest = _etcd_store(context)
        self._events = _event_log(context)

    def register(self, state: Any) -> None:
        """What to save when the runtime stops for a resize: a mapping of name ->
        object with state_dict() (or plain value), or a function returning the state."""
        self._registered = state

    def due(self, step: int) -> bool:
        """True when `every` says so, or (scripts without ElasticSampler) when the job
        agreed to stop at this step; save() then writes it and exits for the resize."""
        self._asks_due = True
        boundary = self._context.boundary if self._context is not None else None
        if boundary is not None and boundary.enabled and not boundary.active:
            boundary.due_driven = True
            if boundary.agree_now():
                self._stopping = True
                self.request_save()
            boundary.write(step, None, stopping=step if self._stopping else None)
        return super().due(step)

    def save(self, step: int, state_dict: Any) -> str | None:
        """Write checkpoint `step`. Given objects (modules, optimizers, the sampler),
        their state_dict() is saved and they are registered for resizes."""
        if holds_objects(state_dict):
            self._registered = state_dict
        where = super().save(step, state_dict if self.config.sharded else state_of(state_dict))
        self._last_saved = step
        if self._stopping:
            self.wait()
            log.warning("spot notice: checkpoint of step %d written; stopping for the resize", step)
            finish()
            raise SystemExit(EXIT_FOR_RESIZE)
        return where

    def restore(self, objects: Mapping[str, Any]) -> int | None:
        """Load the newest verified checkpoint into `objects` (each entry's
        load_state_dict) and register them; return its step, or None if there is none."""
        self._registered = objects
        step = super().restore(objects)
        if self.config.sharded:
            self._emit_loaded()
        return step

    def defers_to_due(self) -> bool:
        """Nothing registered, but the script asks due() every step: let it save."""
        return self._registered is None and self._asks_due

    def stop_at_next_save(self) -> None:
        self._stopping = True
        self.request_save()

    def save_for_resize(self, step: int) -> bool:
        """At an agreed stop: rank 0 (sharded: every rank) saves the registered state of
        `step` and waits for it. True when a checkpoint of `step` exists (saved now or before)."""
        if (self.rank != 0 and not self.config.sharded) or self._closed:
            return self._registered is not None
        if self._last_saved == step:
            self.wait()
            return True
        if self._registered is None:
            log.warning("resize at step %d: nothing registered with the Checkpointer, so "
                        "the steps since the last checkpoint are redone; pass the objects "
                        "(not their state_dict()) to save() or restore(), or call register()",
                        step)
            return False
        registered = self._registered() if callable(self._registered) else self._registered
        self.save(step, registered)
        self.wait()
        return True

    def load_latest(self) -> Any:
        state = super().load_latest()
        self._emit_loaded()
        return state

    def _emit_loaded(self) -> None:
        if self._events is not None and self.rank == 0 and self.loaded_step is not None:
            self._events.emit("checkpoint_loaded", step=self.loaded_step,
                              round=self._context.round)

    def _saved(self, step: int, url: str, duration_s: float) -> None:
        """Verified and published: only now may the event log and metrics say so.
        Runs in the writer thread for async saves (EventLog.emit is thread-safe)."""
        if self._events is not None:
            self._events.emit("checkpoint_saved", step=step, url=url,
                              round=self._context.round, notice=self._stopping,
                              duration_s=duration_s)
        if self._context is not None and self._context.progress_dir:
            _write_checkpoint_progress(self._context.progress_dir, step, url, duration_s)

    def _exit_line(self, error: BaseException) -> str:
        return f"elastic-run worker: error: {error}"


def _etcd_store(context: Context) -> EtcdLatestStore:
    return EtcdLatestStore(context.etcd_endpoints, context.etcd_prefix, context.round,
                           context.etcd_options)


def _event_log(context: Context | None):
    if context is None or not context.events_path:
        return None
    from elastic_runner.events import EventLog
    return EventLog(f"rank{context.rank}", context.run_id, Path(context.events_path))


_progress: list = []  # outside er.init(): the process's one (rank, ProgressWriter | None)


def report(step: int, samples: int) -> None:
    """Tell the agent how far this rank is, for its steps/s and samples/s metrics.

    Cheap enough for every step: no collective, no etcd, at most one small file
    write (temp file + rename) per 0.5 s, and the environment is read once per
    process, not per call. A no-op outside elastic-run (no ELASTIC_RUN_PROGRESS_DIR).
    `samples` counts the samples this rank has trained so far.
    """
    context = current()
    if context is not None:
        context.boundary.user_reports = True
        context.boundary.write(step, samples)
        return
    if not _progress:
        job = WorkerEnv.from_env(os.environ)
        writer = (ProgressWriter(Path(job.progress_dir) / f"rank{job.rank}.json")
                  if job.progress_dir else None)
        _progress[:] = [(job.rank, writer)]
    writer = _progress[0][1]
    if writer is not None:
        writer.write(step, samples)
