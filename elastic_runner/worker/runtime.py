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

import faulthandler
import logging
import os
import signal
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from elastic_runner.contract import EXIT_FOR_RESIZE, STACKS_SIGNAL, ProgressWriter, WorkerEnv
from elastic_runner.reform import DEFERRED, STANDBY_ROUND, ReformChannel, WorkerState
from elastic_runner.worker import formation, quick_exit
from elastic_runner.worker.abort import capturing_sockets, survive_nccl_errors
from elastic_runner.worker.step_boundary import ReformRequested, StepBoundary

log = logging.getLogger("elastic_runner.worker.runtime")

DEFAULT_TIMEOUT_S = 60.0  # forming the process group, and each collective in it

__all__ = ["Context", "EXIT_FOR_RESIZE", "current", "finish", "init", "report"]


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
    run_origin: str = ""  # contract.WorkerEnv.run_origin
    progress_dir: str = ""
    record_socket: str = ""  # the agent's answer for the checkpoint record (record_relay.py)
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
        round=job.round, run_id=job.run_id, run_origin=job.run_origin, backend=backend,
        device=device,
        etcd_endpoints=job.etcd_endpoints, etcd_prefix=job.etcd_prefix,
        etcd_options=_etcd_options(job), notice_path=job.notice_path,
        events_path=job.events_path, progress_dir=job.progress_dir,
        record_socket=job.record_socket)


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


def init(backend: str | None = None, timeout_s: float | None = None, *,
         defer_group: bool = False) -> Context:
    """Join the process group the launcher prepared; bind this worker's GPU.

    The agent shows each worker only its own GPU (CUDA_VISIBLE_DEVICES), so the
    device is cuda:0 whenever exactly one is visible, else cuda:LOCAL_RANK.
    `timeout_s` bounds forming the group and every collective in it; by default the
    launcher's ELASTIC_RUN_COLLECTIVE_TIMEOUT (a silent peer is given up on in time
    to re-form), else DEFAULT_TIMEOUT_S.

    `defer_group`: for a script that trains under `@er.elastic`. Under elastic-run
    the group then forms when the training function is first called, with the ranks
    of the round current at that moment: nodes that join or leave while the workers
    import torch, build the model and restore cost them nothing, where otherwise
    every such change restarts them. Until then `ctx.rank` and `ctx.world_size` are
    the launcher's first guess, and no collective may run (there is no group).
    Ignored outside elastic-run.
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
    if job.quick_exit:
        quick_exit.enable()
    if job.reform_dir:  # the agent may ask where a worker that did not pause is held
        _dump_stacks_on(STACKS_SIGNAL)
    _report_our_errors_in_one_line()  # before the group: its forming can fail (a lost member)
    if defer_group and job.reform_dir and not dist.is_initialized():
        context = _deferred(context, job)
    elif dist.is_initialized():
        _warn_on_hand_typed_ranks(dist.get_rank(), dist.get_world_size(), context)
    elif context.world_size > 1 or "MASTER_ADDR" in environ:
        with capturing_sockets(backend):
            formation.form_first_group(backend, timeout_s, context.round, context.rank,
                                       context.world_size, environ,
                                       under_elastic_run=bool(job.reform_dir))
    _active[:] = [context]
    if context.round == STANDBY_ROUND:
        log.info("local rank %d on %s: %s, no place in the run yet (er.elastic waits "
                 "for one)", context.local_rank, device,
                 "standby" if job.standby else "group deferred")
    else:
        log.info("rank %d/%d (local %d) on %s, round %d, restarts %d", context.rank,
                 context.world_size, context.local_rank, device, context.round,
                 context.restart_count)
    return context


def _deferred(context: Context, job: WorkerEnv) -> Context:
    """This worker's context without a place (er.elastic takes its first one, as a
    standby worker's); the agent hears that it may follow membership changes."""
    context.boundary.close()
    deferred = replace(context, round=STANDBY_ROUND)
    ReformChannel(Path(job.reform_dir)).report(job.local_rank, WorkerState(
        round=STANDBY_ROUND, phase=DEFERRED, step=-1, pid=os.getpid()))
    return deferred


def _dump_stacks_on(signum: int) -> None:
    """faulthandler writes every thread's stack on `signum`; a handler the script had
    still runs after it, but the default action (end the process) does not."""
    previous = signal.getsignal(signum)
    faulthandler.register(signum, all_threads=True,
                          chain=previous not in (signal.SIG_DFL, signal.SIG_IGN, None))


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


def sampler_drives_boundaries(sampler: Any = None) -> None:
    """`sampler` (an ElasticSampler) starts a loop: this process's step boundaries are
    its, from the first step of the round on (sampler.py says why that matters).

    Raises:
        NoPlaceYet: this worker has no place yet (standby, or its group deferred):
            only its @er.elastic function gets one, and training outside it would
            train alone on a guessed rank's share of the data.
    """
    context = current()
    if context is None:
        return
    if context.round == STANDBY_ROUND:
        from elastic_runner.errors import NoPlaceYet

        raise NoPlaceYet("this worker has no place in the run yet (er.init(defer_group=True), "
                         "or started on standby), so it cannot train outside its "
                         "@er.elastic function: start the sampler's loop inside it")
    context.boundary.active = True
    context.boundary.sampler = sampler  # er.elastic checks it is the State's (elastic.py)


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
        quick_exit.exit_for_resize()
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
    quick_exit.exit_for_resize()


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
