"""`@er.elastic(state)`: a training function that survives a resize in its own process.

Why: the restart path (runtime.py) stops every worker, starts new processes and
reads the last checkpoint: seconds of startup, and every step since that checkpoint
re-done. A worker whose state is an `er.State` can instead pause, leave the old
process group, join the new one and call the training function again, keeping its
state in memory (a newcomer receives it from a peer: State.sync).

The worker's half of the channel in reform.py, one round at a time:

1. The process group of the first round is the one `er.init()` formed. Once in a
   round's group, the worker reports TRAINING for it (this is how the agent learns
   that it can re-form in place), synchronises the State, and calls `fn(state)`.
2. The round ends for this worker at a step boundary every rank agreed on (the
   agent asked a pause, or a node leaves with notice: step_boundary.py raises
   ReformRequested; zero steps re-done), or when a collective fails because a
   peer died or went silent (gloo raises a plain RuntimeError, see
   `collective_failure`; the step in flight is re-done). It leaves the group and
   reports PAUSED with the reason ("asked", or "collective-error: <first line>").
3. It polls its Assignment (every POLL_S) until one for a later round appears; at
   most ASSIGNMENT_TIMEOUT_S, then it reports FAILED and exits with EXIT_FOR_RESIZE.
   `leave`: this node is not in the new round; it exits with EXIT_FOR_RESIZE and no
   checkpoint (the ranks that stay hold the state). Otherwise it takes its new place
   (environment, Context, process group) and goes back to 1. The group is formed in
   steps that can be called off (formation.py): a round that lost a member before
   its group formed is paused in at once when the agent asks, not after the
   formation timeout.

A worker started on standby (its node had not joined yet, agent/standby.py) has no
process group when it gets here: it reports STANDBY, waits for its first assignment
as in 3., and goes to 1. with the model already built. So does a worker whose
`er.init(defer_group=True)` formed none (agent/deferred.py); its first group waits
for the other members as long as er.init() would have (the collective timeout).

Anything that stops a worker from re-forming is reported FAILED (the agent then
takes the restart path for the round). Outside elastic-run (no ELASTIC_RUN_REFORM_DIR:
a plain `python` run, or torchrun), `fn(state)` is simply called once. A script
without `@er.elastic` never reports, so its agent keeps the restart path.
"""

from __future__ import annotations

import datetime
import functools
import gc
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from elastic_runner.contract import WorkerEnv, variable
from elastic_runner.errors import NoPlaceYet, StaleWriterError
from elastic_runner.reform import (
    ASKED, COLLECTIVE_ERROR, FAILED, PAUSED, STANDBY, STANDBY_ROUND, TRAINING, Assignment,
    ReformChannel, WorkerState,
)
from elastic_runner.worker import formation, runtime
from elastic_runner.worker.abort import (
    capturing_new_groups, capturing_sockets, group_sockets, leave_process_group,
)
from elastic_runner.worker.broken_round import BrokenRoundWatch
from elastic_runner.worker.quick_exit import exit_for_resize
from elastic_runner.worker.state import ShardedStateError, State
from elastic_runner.worker.state_coverage import CoverageWarnings
from elastic_runner.worker.step_boundary import ReformRequested

log = logging.getLogger("elastic_runner.worker.elastic")

# How often a paused worker reads its assignment: a stat and a small JSON parse, and
# every millisecond here is a millisecond of paused training.
POLL_S = 0.01
# How long a paused worker waits for its assignment. Only a safety net: the agent
# bounds each of its own waits and stops its workers when it gives up, and a worker
# dies with its agent; so it exceeds the rendezvous' default --join-timeout (600 s),
# which the agent may spend waiting for enough nodes while its workers stay paused.
ASSIGNMENT_TIMEOUT_S = 900.0
# What a failed collective says: gloo raises a plain RuntimeError whose text names its
# transport ("[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer ..." when
# a peer process died, "Read error ...: Connection reset by peer" from DDP's backward,
# "[.../unbound_buffer.cc:78] Timed out waiting 5000ms for recv ..." for a frozen
# peer); torch's own DistError types cover the store and NCCL. Not any text naming
# gloo: "Tensors must be CPU and dense" is the script's bug, not a lost peer.
_COLLECTIVE_SIGNS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                     "Broken pipe", "Timed out waiting")
_REASON_CHARS = 500
# A collective that fails at the same step in this many rounds in a row fails for a
# reason a new group does not cure (a script's bug torch reports as a DistError): the
# worker then fails with it, and the agent takes the restart path, which counts it.
MAX_FAILURES_PER_STEP = 3


def collective_failure(error: BaseException) -> str | None:
    """The first line of `error` when it says a collective failed, else None."""
    import torch.distributed as dist

    text = str(error)
    failed = isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(sign in text for sign in _COLLECTIVE_SIGNS))
    if not failed:
        return None
    lines = text.strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:_REASON_CHARS]


def elastic(state: State) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate the training function `fn(state, ...)`; call it as `fn(...)`.

    It runs `fn(state, ...)` in this round's process group and, after each in-process
    re-formation, again in the new one (so build what depends on the group, DDP
    included, inside it), and returns what its last call returns. See the module
    docstring for the rounds; a State holding sharded tensors keeps the restart path.
    """
    if not isinstance(state, State):
        raise TypeError(f"er.elastic needs an er.State, got {type(state).__name__}")

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):  # found here, not at the first call after the model is built
            raise TypeError(f"er.elastic(state) decorates a training function, got "
                            f"{type(fn).__name__}")

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            return _run(state, functools.partial(fn, state, *args, **kwargs))
        return run

    return decorate


def _run(state: State, call: Callable[[], Any]) -> Any:
    context = runtime.current()
    job = WorkerEnv.from_env(os.environ)
    if not job.reform_dir:
        return call()  # outside elastic-run: nobody to re-form with
    channel = ReformChannel(Path(job.reform_dir))
    if context is None:
        _keep_restart_path(channel, job, "er.init() was not called, so this worker cannot "
                                         "re-form in place")
        return call()
    try:
        state.check_replicated()
    except ShardedStateError as error:
        _keep_restart_path(channel, job, str(error))
        return call()  # never reports: the agent keeps the restart path
    bound = _bound_before_training(context)
    if bound is not None:
        _keep_restart_path(channel, job, bound)
        return call()
    return Reformer(state, context, channel, job).run(call)


def _bound_before_training(context: runtime.Context) -> str | None:
    """Why this worker cannot re-form in place, when the script made something bound
    to the first round's process groups before its training function: a
    DistributedDataParallel wrapper, or a group of its own (dist.new_group, a
    DeviceMesh's). Else None.

    Why: the first re-formation destroys those groups, and the script keeps using
    them. Measured before this check (examples/train_inproc.py with its DDP, or a
    side group for its all-reduce, made above `@er.elastic`; a third node joining
    two): the survivors' collectives timed out on the old group, the job re-formed in
    place again and again and ended with exit 6 (on "DDP expects same model across all
    ranks" for the DDP). On the restart path every process makes them on its own
    round's group, so the script is correct there, only slower. One scan of the heap
    before the first call: 35 ms at 170,000 objects.
    """
    wrapped, groups = _ddp_wrappers(), _groups_of_the_script(context)
    if not wrapped and not groups:
        return None
    made = " and ".join(part for part in (
        f"{wrapped} DistributedDataParallel wrapper(s)" if wrapped else "",
        f"{groups} process group(s) of its own" if groups else "") if part)
    return (f"the script made {made} before the training function, bound to process groups "
            "that re-forming in place replaces; make them inside the function decorated with "
            "@er.elastic (it is called again after each re-formation) to re-form in place")


def _ddp_wrappers() -> int:
    from torch.nn.parallel import DistributedDataParallel

    def count() -> int:
        return sum(1 for each in gc.get_objects()
                   if issubclass(type(each), DistributedDataParallel))
    if not count():
        return 0
    gc.collect()  # one the script dropped may wait in a reference cycle
    return count()


def _groups_of_the_script(context: runtime.Context) -> int:
    """Process groups besides the default one and the runtime's own (the step
    boundary's, a sharded Checkpointer's)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    # torch 2.13: every live group is a key of distributed_c10d._world.pg_map.
    registry = getattr(getattr(c10d, "_world", None), "pg_map", None)
    if not dist.is_initialized() or not isinstance(registry, dict):
        return 0
    ours = {dist.group.WORLD, getattr(context.boundary, "_group", None),
            *(getattr(getattr(each, "_sharded", None), "_group", None)
              for each in context.checkpointers)}
    return sum(1 for group in registry if group not in ours)


def _keep_restart_path(channel: ReformChannel, job: WorkerEnv, why: str) -> None:
    """Say why this worker cannot re-form in place. A standby worker has no place
    to train in without it: it reports FAILED and exits (its agent then starts a
    fresh worker once its round closes). A worker whose group er.init() deferred
    has none either, and a fresh one would defer it again: that is the script's
    mistake, told in one line (NoPlaceYet)."""
    context = runtime.current()
    if not job.standby and context is not None and context.round == STANDBY_ROUND:
        raise NoPlaceYet(f"er.init(defer_group=True) leaves the process group to "
                         f"@er.elastic, but {why}: drop defer_group=True")
    if not job.standby:
        log.warning("er.elastic: %s; this worker keeps the restart path", why)
        return
    log.error("standby worker cannot wait for its place: %s", why)
    channel.report(job.local_rank, WorkerState(round=STANDBY_ROUND, phase=FAILED, step=-1,
                                               pid=os.getpid(), reason=why[:_REASON_CHARS]))
    exit_for_resize()


class Reformer:
    """One worker's rounds: train, pause, wait for its place, re-form, train again."""

    def __init__(self, state: State, context: runtime.Context, channel: ReformChannel,
                 job: WorkerEnv, assignment_timeout_s: float | None = None):
        self.state, self.context, self.channel, self.job = state, context, channel, job
        self.assignment_timeout_s = (ASSIGNMENT_TIMEOUT_S if assignment_timeout_s is None
                                     else assignment_timeout_s)
        self._failed_at: tuple[int, int] = (-2, 0)  # (step, consecutive failures there)
        self._frozen = False  # gc.freeze() done (_freeze_survivors)
        self._coverage = CoverageWarnings()
        # er.init(defer_group=True) on a member node: until its first group formed, a
        # group waits for every member's script to reach its training function, not
        # for paused peers.
        self._first_group = context.round == STANDBY_ROUND and not job.standby

    def run(self, call: Callable[[], Any]) -> Any:
        if self.context.round == STANDBY_ROUND:
            self._freeze_survivors()  # no group exists yet
            self._take_first_place()
        self._attach()
        self._report(TRAINING)
        self._coverage.check(self.state, None)
        while True:
            try:
                with BrokenRoundWatch(self.channel, lambda: self.context.round, group_sockets), \
                        capturing_new_groups(self._meet_members):
                    self.state.sync()
                    result = call()
            except ReformRequested:
                reason = ASKED
            except RuntimeError as error:
                first_line = collective_failure(error)
                if first_line is None or self._hopeless():
                    raise
                reason = f"{COLLECTIVE_ERROR}: {first_line}"
                self.state.rollback()
            else:
                self._report(TRAINING)
                self._detach()
                return result
            self._reform(reason)

    def _meet_members(self, store, group_name: str, members: int, timeout_s: float) -> None:
        """A group made in this round forms only once its members met (formation.py),
        and not at all once the agent cut the round."""
        round_number = self.context.round
        formation.meet_members(store, group_name, members, timeout_s,
                               called_off=lambda: self.channel.broken(round_number))

    def _hopeless(self) -> bool:
        """Collectives failed at this step in more than MAX_FAILURES_PER_STEP rounds."""
        step, count = self._failed_at
        self._failed_at = (self.state.step, count + 1 if step == self.state.step else 1)
        return self._failed_at[1] > MAX_FAILURES_PER_STEP

    # ---- one re-formation ------------------------------------------------------------
    def _reform(self, reason: str) -> None:
        log.warning("round %d ends for rank %d after step %d (%s); re-forming in place",
                    self.context.round, self.context.rank, self.state.step, reason)
        self._check_state_covers_the_loop()
        self._refuse_sharded(reason)
        self._leave_group(cut=reason.startswith(COLLECTIVE_ERROR))
        self._report(PAUSED, reason)
        self._take_place(self._leave_job)
        self._report(TRAINING)

    def _take_place(self, leave: Callable[[Assignment], None]) -> None:
        """Join the round of the next assignment (`leave` it when this node is not in
        it). A round whose group does not form in time (a member never came: it was
        reclaimed or died after the round closed) is paused in, reported, and the
        assignment after it taken: the agent re-forms without the missing member."""
        while True:
            assignment = self._await_assignment()
            if assignment.leave:
                leave(assignment)
            if self._join(assignment):
                return

    def _check_state_covers_the_loop(self) -> None:
        """Name, once, what the loop uses that the State does not hold (its sampler, an
        LR scheduler, a GradScaler, an EMA): it would not follow this re-formation
        (state_coverage.py)."""
        self._coverage.check(self.state, self.context.boundary.sampler)

    def _refuse_sharded(self, reason: str) -> None:
        """A sharded State cannot be kept: the restart path takes over. After an asked
        pause the group still works, so this step is checkpointed as on that path
        (exit EXIT_FOR_RESIZE, which the agent reads as "cannot re-form" once it
        assigns the next round); after a failed collective the worker reports FAILED
        and fails with the error."""
        try:
            self.state.check_replicated()
        except ShardedStateError as error:
            if reason == ASKED:
                log.warning("%s", error)
                runtime.stop_for_resize(self.context, self.state.step)
            self._report(FAILED, str(error))
            raise

    def _leave_group(self, cut: bool = False) -> None:
        """`cut`: the round broke under this rank; its peers must not wait on it."""
        self.context.boundary.abandon()
        leave_process_group(log, cut)  # NCCL: abort the communicators, never wait on a dead peer
        # The last call's objects (a DDP and its autograd hooks on the parameters) and
        # the group just left, if they are garbage in a cycle, must go before the next
        # call builds their successors: a group kept alive keeps its sockets open, and
        # a peer blocked on one of them would not see this rank go.
        gc.collect()
        self._freeze_survivors()

    def _freeze_survivors(self) -> None:
        """Once, while this worker holds no process group: freeze what lives now out
        of the collector's walks (gc.freeze). Why: a full collection walks every
        object torch and the model made, 0.2-0.45 s of paused training per
        re-formation on this machine; what lives between two groups (modules, the
        model, the State) lives for the run, and frozen, the walk takes a millisecond.
        Never with a group alive: a frozen group in a cycle would never be freed."""
        if self._frozen:
            return
        gc.freeze()
        self._frozen = True

    def _await_assignment(self) -> Assignment:
        deadline = time.monotonic() + self.assignment_timeout_s
        while True:
            assignment = self.channel.assignment(self.context.local_rank)
            if assignment is not None and assignment.round > self.context.round:
                return assignment
            if time.monotonic() >= deadline:
                self._fail(f"no assignment for a round after {self.context.round} within "
                           f"{self.assignment_timeout_s:g} s")
            time.sleep(POLL_S)

    def _take_first_place(self) -> None:
        """A standby worker: the script is ready up to here; wait for a place."""
        log.info("standby: local rank %d is ready and waits for its place",
                 self.context.local_rank)
        self._report(STANDBY)
        self._take_place(_give_up_standby)

    def _leave_job(self, assignment: Assignment) -> None:
        """This node is not in the new round: finish (pending saves) and exit."""
        log.warning("this node is not in round %d: rank %d leaves after step %d (the ranks "
                    "that stay keep the state)", assignment.round, self.context.rank,
                    self.state.step)
        self._report(PAUSED, f"leaving: not in round {assignment.round}")
        try:
            runtime.finish()
        except StaleWriterError as error:  # its round is over: expected, and harmless
            log.warning("%s", error)
        exit_for_resize()

    def _join(self, assignment: Assignment) -> bool:
        """Take this worker's place in the assignment's round: True once in its group;
        False when the group did not form within the formation timeout (this worker
        is then PAUSED in that round); FAILED for anything else."""
        import torch.distributed as dist

        _export(assignment)
        timeout_s = self._formation_timeout_s()
        try:
            store = formation.meet(
                formation.Place(assignment.round, assignment.rank, assignment.world_size,
                                assignment.master_addr, assignment.master_port),
                timeout_s, formation.called_off_by(self.channel, self.context.local_rank,
                                                   assignment.round))
            if store is None:
                return self._called_off_before_forming(assignment)
            with capturing_sockets(self.context.backend):
                init_timeout_s = formation.init_timeout_s(self.context.backend, timeout_s)
                dist.init_process_group(self.context.backend, store=store,
                                        rank=assignment.rank, world_size=assignment.world_size,
                                        timeout=datetime.timedelta(seconds=init_timeout_s))
        except Exception as error:  # noqa: BLE001 - every way of failing is told to the agent
            first_line = collective_failure(error)
            if first_line is None or formation.port_taken(error, assignment.rank):
                self._fail(f"cannot join round {assignment.round}: {error}".splitlines()[0])
            self._move(assignment)
            leave_process_group(log)
            log.warning("round %d did not form (%s); waiting for the next one",
                        assignment.round, first_line)
            self._report(PAUSED, f"{COLLECTIVE_ERROR}: round {assignment.round} did not "
                                 f"form: {first_line}")
            return False
        try:
            # Formed: collectives get the full collective timeout again
            # (distributed_c10d._set_pg_timeout sets the backend's default timeout).
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(
                seconds=runtime.group_timeout_s(self.job)))
            self._move(assignment)
        except Exception as error:  # noqa: BLE001 - every way of failing is told to the agent
            self._fail(f"cannot join round {assignment.round}: {error}".splitlines()[0])
        self._attach()
        self._first_group = False
        log.warning("re-formed in place: rank %d of %d in round %d", assignment.rank,
                    assignment.world_size, assignment.round)
        return True

    def _formation_timeout_s(self) -> float:
        """How long to wait for the round's group. A deferred first group waits as
        long as er.init() would have (the collective timeout): the other members may
        still be building their models, where a re-formed round's members are all
        paused and ready within moments (the launcher's shorter formation timeout)."""
        if self._first_group:
            return runtime.group_timeout_s(self.job)
        return _formation_timeout_s(self.job)

    def _called_off_before_forming(self, assignment: Assignment) -> bool:
        """Paused in that round, as a worker that trained in it would be; False."""
        self._move(assignment)
        log.warning("round %d was called off before its group formed; waiting for the "
                    "next one", assignment.round)
        self._report(PAUSED, ASKED)
        return False

    def _move(self, assignment: Assignment) -> None:
        self.context.move(assignment.rank, assignment.world_size, assignment.local_world_size,
                          assignment.restart_count, assignment.round)

    def _fail(self, reason: str) -> None:
        log.error("in-process re-formation failed: %s", reason)
        self._report(FAILED, reason)
        exit_for_resize()

    # ---- the step boundary and the channel ----------------------------------------------
    def _attach(self) -> None:
        """The step boundary of this round's group asks the channel for pauses and
        tells the State of every completed step."""
        boundary, channel, context = self.context.boundary, self.channel, self.context
        boundary.pause_asked = lambda: channel.pause_asked(context.round)
        boundary.on_completed = self.state.completed

    def _detach(self) -> None:
        self.context.boundary.pause_asked = None
        self.context.boundary.on_completed = None

    def _report(self, phase: str, reason: str = "") -> None:
        self.channel.report(self.context.local_rank, WorkerState(
            round=self.context.round, phase=phase, step=self.state.step, pid=os.getpid(),
            reason=reason))


def _give_up_standby(assignment: Assignment) -> None:
    """The node gave up joining before its standby workers got a place."""
    exit_for_resize()


def _formation_timeout_s(job: WorkerEnv) -> float:
    """How long to wait for a new round's group: the launcher's formation timeout."""
    return float(job.formation_timeout_s) if job.formation_timeout_s > 0 \
        else runtime.group_timeout_s(job)


def _export(assignment: Assignment) -> None:
    """The new round's torchrun variables. This is the worker process's own environment,
    which the runtime owns: scripts read their rank from it, and torch's env:// init
    reads MASTER_ADDR/PORT, RANK and WORLD_SIZE from it."""
    values = {
        "rank": assignment.rank, "world_size": assignment.world_size,
        "local_world_size": assignment.local_world_size, "group_rank": assignment.group_rank,
        "group_world_size": assignment.group_world_size, "role_rank": assignment.rank,
        "role_world_size": assignment.world_size, "master_addr": assignment.master_addr,
        "master_port": assignment.master_port, "round": assignment.round,
        "restart_count": assignment.restart_count,
    }
    os.environ.update({variable(name): str(value) for name, value in values.items()})
