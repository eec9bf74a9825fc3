"""In-process re-formation, the agent's half (issue 15): workers keep their processes.

Why a module of its own: agent.py decides *when* (its monitor sees the change); this
module does the *how*, one bounded sequence per round, and reports it in events.

When. Every local worker of the round has reported TRAINING for it through the
channel (reform.py): the group is *capable*. Then any of these starts a re-formation:
the plan stops holding (`change_reason`: a newcomer, a member lost), a peer announced
its departure (a spot notice in etcd), or a local worker paused on its own. A pause
with a collective error is evidence that a member died: the rendezvous hears it
(`suspect`) so the next round opens now instead of after a lease expires. A group
that is not capable (a plain script never reports) keeps the restart path, unchanged.

The sequence (`InProcessReform.run`), for round r:
1. ask the workers to pause at their next step boundary (`ask_pause(r)`);
2. join the next round (`next_plan`) at once, before the pause completes: a round
   opened on suspicion leaves out members that have not joined within
   --suspect-grace (1 s), and a worker blocked in a collective with a frozen peer
   pauses only when that collective times out (`collective_timeout_s`). For a
   newcomer the order is the other way round: the workers train on until the round
   closes (the newcomer's standby workers are ready by then, standby.py), and only
   then are asked to pause. When this node's own lease expired, the workers leave
   their round before the node registers again (`_rejoin_once_paused`);
3. wait until every local worker reported PAUSED for r, or exited: at most
   `pause_s`. A graceful pause whose new round lacks a member of r (it froze or
   died meanwhile) is cut as for a loss when no boundary comes within a few steps
   (`_cut_if_held`): that member may hold the collective in flight;
4. write each worker its place in the new round (same local rank, new global rank),
   or, when this node is not in it, `leave` and wait for them to exit;
5. wait until every worker reported TRAINING for the new round: at most `form_s`.
   A member of the new round lost before its group formed calls the round off
   (`forming_watch`, round_watch.py): the workers stop forming it and report PAUSED
   in it, and the next re-formation starts from there at once. The pause of step 3
   is watched the same way (`pausing_watch`): a member lost gets the round cut.
Anything that goes wrong on the way (a worker FAILED or exited, a bound passed, this
node's worker count changed) ends in the fallback: the workers are stopped and the
agent takes the restart path for that round, with one line and one `reform_fallback`
event. A signal, an etcd outage or the end of the run stops the workers and goes on up.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from elastic_runner.agent import drain
from elastic_runner.agent.ports import Rendezvous, Workers
from elastic_runner.agent.round_watch import LossWatch
from elastic_runner.config import AgentConfig
from elastic_runner.contract import EXIT_FOR_RESIZE, read_progress
from elastic_runner.errors import LeaseLost, RendezvousError, ShutdownRequested
from elastic_runner.events import EventLog
from elastic_runner.reform import FAILED, PAUSED, TRAINING, Assignment, ReformChannel, WorkerState
from elastic_runner.rendezvous.protocol import Cause, CauseKind, Plan
from elastic_runner.rendezvous.ranks import assign_ranks, plan_problem

log = logging.getLogger("elastic_runner")

# How often the channel is read while waiting: a read is a stat and a small JSON
# parse per worker, and every millisecond here is a millisecond of paused training.
POLL_S = 0.005
# Causes that leave the round's group unable to finish a collective: the workers are
# told to cut it (worker/broken_round.py) rather than wait for a step boundary. Our own
# lease expired (a freeze): the others re-formed without us, so our collective in flight
# never completes (a chaos soak: a thawed node's workers sat out the 12 s collective
# timeout while the others waited for them, 24 s without a step).
BROKEN_BY = frozenset({CauseKind.MEMBER_LOST, CauseKind.MEMBER_SUSPECTED,
                       CauseKind.LEASE_EXPIRED})


class ReformFallback(Exception):
    """A step of the re-formation failed; the restart path takes this round (internal:
    caught by `InProcessReform.run`). `stuck`: local ranks that did not pause in time
    (their stacks go to their logs first)."""

    def __init__(self, why: str, stuck: tuple[int, ...] = ()):
        super().__init__(why)
        self.stuck = stuck


# Past a collective timeout, the time a worker needs to leave its group and report.
PAUSE_MARGIN_S = 5.0


@dataclass(frozen=True)
class ReformBounds:
    """How long each wait of the sequence may take before the restart path takes over."""

    pause_s: float  # every worker PAUSED (or exited) after ask_pause
    form_s: float  # every worker TRAINING in the new round after its assignment
    leave_s: float  # every worker exited after Assignment(leave=True)

    @classmethod
    def from_config(cls, config: AgentConfig) -> ReformBounds:
        """Derived from the rendezvous' own patience.

        pause: --drain-timeout, the time a new round waits for the last plan's members,
        and never less than one collective timeout: a worker blocked on a frozen peer
        only pauses when its collective gives up (`collective_timeout_s`, which passes
        the drain timeout for long lease TTLs), and falling back then would throw away
        a re-formation that was about to succeed. A worker past both is stuck in user
        code. form: a newcomer's processes start within the same patience, and the new
        process group then forms within one collective timeout. leave: a paused worker
        reads its assignment within milliseconds; the pause's bound is ample.
        """
        rdzv = config.rendezvous
        return cls(pause_s=max(rdzv.drain_timeout_s, rdzv.collective_timeout_s + PAUSE_MARGIN_S),
                   form_s=rdzv.drain_timeout_s + rdzv.collective_timeout_s,
                   leave_s=rdzv.drain_timeout_s)


def _in_round(state: WorkerState | None, number: int, phases: tuple[str, ...]) -> bool:
    return state is not None and state.round == number and state.phase in phases


@dataclass(frozen=True)
class ReformContext:
    """What the sequence needs from its agent."""

    channel: ReformChannel
    rendezvous: Rendezvous
    events: EventLog
    node_id: str
    bounds: ReformBounds
    stop_requested: threading.Event  # a signal arrived: stop waiting at once
    stop_grace_s: float
    max_restarts: int
    progress_dir: Path  # workers' progress files, named by global rank
    notice_path: Path  # the spot-notice marker


class InProcessReform:
    """One node's in-process re-formations, round after round."""

    def __init__(self, context: ReformContext):
        self._ctx = context
        self._capable_round: int | None = None
        self._marked = False  # the run is marked as re-forming in place (once per agent)
        self._called_off_round = -1  # the last round called off before its group formed
        self._first_group = False  # deferred workers that never formed a group yet

    def reset(self) -> None:
        """Fresh workers start (the restart path): forget every report."""
        self._ctx.channel.reset()
        self._capable_round = None
        self._first_group = False

    def capable(self, plan: Plan, workers: int) -> bool:
        """Every local worker reported TRAINING for `plan`'s round (a later PAUSED for
        it counts too: only a worker that trained in the round can pause it)."""
        if self._capable_round == plan.round:
            return True
        states = self._ctx.channel.states()
        if workers > 0 and all(_in_round(states.get(local), plan.round, (TRAINING, PAUSED))
                               for local in range(workers)):
            self._became_capable(plan.round)
            return True
        return False

    def _became_capable(self, round_number: int) -> None:
        self._capable_round = round_number
        self.mark_run(round_number)

    def mark_run(self, round_number: int) -> None:  # newcomers then start workers first
        if not self._marked:
            self._ctx.rendezvous.mark_in_place(round_number)
            self._marked = True

    def trigger(self, plan: Plan, notices: list[str]) -> Cause | None:
        """A reason to re-form that the plan itself does not show yet, or None."""
        node = self._ctx.node_id
        paused = sorted((local, state) for local, state in self._ctx.channel.states().items()
                        if _in_round(state, plan.round, (PAUSED,)))
        for local, state in paused:
            if state.saw_collective_error:
                return Cause.member_suspected(f"{node} local rank {local}", state.reason)
        leaving = [other for other in notices if other != node]
        if leaving:
            return Cause(CauseKind.NOTICE, ",".join(leaving))
        if paused:  # a peer's stop reached our workers before its notice reached us
            local, state = paused[0]
            return Cause(CauseKind.OTHER,
                         f"{node} local rank {local} paused ({state.reason or 'no reason'})")
        return None

    # ---- the sequence -----------------------------------------------------------
    def run(self, group: Workers, plan: Plan, cause: Cause, paused_at: float) -> Plan | None:
        """Re-form `group` from `plan` in place; the new plan, or None when the workers
        are gone (fallback: stopped; not in the new round: left)."""
        self._ctx.events.emit("reform_started", round=plan.round, reason=cause.text(),
                              inprocess=True)
        ok, new = self._attempt(
            group, lambda: self._reform(group, plan, cause), plan.round, "reform_fallback",
            "in-process re-formation after round %d failed (%s); stopping the workers and "
            "restarting them")
        if ok and new is not None and new.round != self._called_off_round:
            self._announce(plan, new, time.monotonic() - paused_at)
        return new

    def _attempt(self, group: Workers, attempt: Callable[[], Plan | None], round_number: int,
                 event: str, message: str) -> tuple[bool, Plan | None]:
        """(True, what `attempt` returned), or (False, None) after a ReformFallback: then
        the workers were stopped, with one line (`message`) and one `event`. Any other
        error stops them too and goes on up."""
        try:
            return True, attempt()
        except ReformFallback as why:
            log.warning(message, round_number, why)
            self._ctx.events.emit(event, round=round_number, reason=str(why))
            if why.stuck:  # where each was held, for whoever reads the fallback
                log.warning("their Python stacks are in their logs")
                group.dump_stacks(why.stuck)
            group.stop(self._ctx.stop_grace_s)
            return False, None
        except BaseException:
            group.stop(self._ctx.stop_grace_s)
            raise

    def _reform(self, group: Workers, plan: Plan, cause: Cause) -> Plan | None:
        if cause.kind is CauseKind.MEMBER_SUSPECTED:  # open the next round now
            self._ctx.rendezvous.suspect(plan, cause)
        try:
            new = self._next_round(group, plan, cause)
        except LeaseLost:  # found only now: a thawed node can see a stale change first
            cause = Cause(CauseKind.LEASE_EXPIRED)
            new = self._rejoin_once_paused(group, plan, cause)
        problem = plan_problem(new)
        if problem:
            raise RendezvousError(f"refusing to re-form workers on round {new.round}: {problem}")
        if cause.kind in BROKEN_BY:  # cut already
            self._wait_paused(group, plan)
        else:  # graceful: cut once a member is found missing or lost meanwhile
            watch = self.pausing_watch(plan, new)
            self._cut_if_held(group, plan, new, watch)
            self._wait_paused(group, plan, watch)
        ranks = assign_ranks(new, self._ctx.node_id)
        if not ranks:
            self._leave(group, new)
            return None
        self._take_places(group, new, "exited during the pause")
        return new

    def _next_round(self, group: Workers, plan: Plan, cause: Cause) -> Plan:
        """The plan to re-form on; a lease found gone meanwhile raises LeaseLost."""
        if cause.kind is CauseKind.LEASE_EXPIRED:
            return self._rejoin_once_paused(group, plan, cause)
        if cause.kind is CauseKind.NEWCOMER:
            # Nothing is lost by training on until the round closes: a newcomer's
            # standby workers are ready by the time it joins (standby.py), so the
            # pause is the process group and the state transfer only.
            new = self._ctx.rendezvous.next_plan(plan, cause, rejoin=False)
            self._ctx.channel.ask_pause(plan.round)
            return new
        # A member is gone or leaving: stop at the next step boundary, or at once
        # when it is gone (a collective waiting for it would only time out).
        self._ctx.channel.ask_pause(plan.round, broken=cause.kind in BROKEN_BY)
        return self._ctx.rendezvous.next_plan(plan, cause, rejoin=False)

    def _rejoin_once_paused(self, group: Workers, plan: Plan, cause: Cause) -> Plan:
        """This node froze past its lease: the others re-formed without it. Its workers
        leave their round before the node registers again, as standby workers get
        ready before a newcomer announces itself (standby.py).

        Why: the registration opens a round for this node at once; the others pause
        when it closes, then wait for these workers to form it. A thawed worker can
        stay held in its old round long after (chaos soaks: ~6 s with three nodes
        paused; 15.6 s where the monitor first saw a stale newcomer and next_plan
        found the lease gone). Waiting here costs only this node's own return.
        """
        self._ctx.channel.ask_pause(plan.round, broken=True)
        self._wait_paused(group, plan)
        return self._ctx.rendezvous.next_plan(plan, cause)

    def _wait_paused(self, group: Workers, plan: Plan, watch: LossWatch | None = None) -> None:
        """Until every worker paused in round `plan`; with `watch`, the round is cut once
        the rendezvous reports a loss that holds it."""
        check = watch.check if watch is not None else (lambda left: left)
        self._wait(lambda: check(self._not_paused(group, plan.round)),
                   self._ctx.bounds.pause_s, "pause")

    def _cut_if_held(self, group: Workers, plan: Plan, new: Plan, watch: LossWatch) -> None:
        """Cut round `plan` when a member it holds is missing from `new` and the
        workers do not reach a step boundary in the time a step takes.

        Why: a graceful pause (a newcomer, a notice) waits for the step boundary,
        but a member that froze meanwhile holds the collective in flight until it
        thaws; the next round closed without it once its lease went, while this
        pause waited on (seen in a chaos soak: 5.6 s, the whole freeze). A member
        that left at the agreed boundary (a notice) costs nothing here: its peers
        pause at that boundary within a step. The bound is the drain's agreement
        wait (4 of the workers' median steps, at least 1 s)."""
        missing = sorted(set(plan.node_ids) - set(new.node_ids))
        if not missing:
            return
        steps = drain.view(read_progress(self._ctx.progress_dir))

        def cut() -> None:
            if watch.seen is not None:
                return  # cut already, for a loss the rendezvous reported
            log.warning("round %d lost %s while its workers paused for round %d; they "
                        "reached no step boundary in time: cutting the round", plan.round,
                        ", ".join(missing), new.round)
            self._ctx.channel.ask_pause(plan.round, broken=True)

        self._wait(lambda: watch.check(self._not_paused(group, plan.round)),
                   drain.agreement_wait(steps, self._ctx.bounds.pause_s), "pause", cut)

    def pausing_watch(self, plan: Plan, new: Plan) -> LossWatch:
        """Cuts round `plan` once a member of `new` is lost while the workers pause
        for it (round_watch.py): a member that froze after `new` closed holds the
        collective in flight, and no step boundary comes until it thaws."""
        def cut(cause: Cause) -> None:
            log.warning("round %d lost a member while its workers paused for round %d "
                        "(%s): cutting the round", plan.round, new.round, cause.text())
            self._ctx.channel.ask_pause(plan.round, broken=True)
        return LossWatch(self._ctx.rendezvous, self._ctx.node_id, new,
                         lambda cause: _holds_round(cause, plan), cut, notices=False)

    def forming_watch(self, new: Plan, newcomers: bool = False) -> LossWatch:
        """Calls round `new` off once one of its members is gone before its group
        formed (round_watch.py): the workers stop forming it and report PAUSED in
        it, and the monitor re-forms from there as after any pause. `newcomers`: a
        newcomer calls it off too (a first group of deferred workers, until it formed:
        members still on their way follow the newcomer's round, agent/deferred.py)."""
        def call_off(cause: Cause) -> None:
            log.warning("round %d lost a member before its group formed (%s); asking the "
                        "workers to stop forming it", new.round, cause.text())
            self._ctx.channel.ask_pause(new.round)
        # A newcomer is no reason where every member is ready: the group forms, and
        # takes it in afterwards.
        return LossWatch(self._ctx.rendezvous, self._ctx.node_id, new,
                         lambda cause: newcomers or cause.kind is not CauseKind.NEWCOMER,
                         call_off, notices=True)

    def place(self, group: Workers, plan: Plan, deferred: bool = False) -> bool:
        """Give standby workers (standby.py), or workers whose group er.init() deferred
        (`deferred`, agent/deferred.py), their places in `plan`; False when they could
        not take them (then they were stopped, with one line and one event)."""
        self._first_group = deferred
        who, exited = ("the workers", "exited before their place") if deferred else \
            ("the standby workers", "exited on standby")
        ok, _ = self._attempt(
            group, lambda: self._take_places(group, plan, exited), plan.round,
            "standby_fallback", f"{who} could not take their places in round %d (%s); "
            "starting fresh workers")
        return ok

    def _take_places(self, group: Workers, new: Plan, exited: str) -> None:
        """Assign every worker its place in `new`; wait until all trained in it."""
        ranks = assign_ranks(new, self._ctx.node_id)
        gone = [exit.local_rank for exit in group.poll() if exit is not None]
        if gone or len(ranks) != len(group.pids):
            raise ReformFallback(
                f"worker local rank(s) {_ranks(gone)} {exited}" if gone else
                f"round {new.round} gives this node {len(ranks)} workers, it runs "
                f"{len(group.pids)}")
        self._assign(group, new)
        watch = self.forming_watch(new, newcomers=self._first_group)
        self._wait(lambda: watch.check(self._not_formed(group, new.round)),
                   self._ctx.bounds.form_s, "re-form")
        if watch.seen is not None:
            self._called_off_round = new.round
        self._first_group = self._first_group and watch.seen is not None
        self._became_capable(new.round)

    def _assign(self, group: Workers, new: Plan) -> None:
        # As for a fresh start: a progress file named by an old global rank must not
        # make its new owner look hung, nor a stale marker stop the new round.
        for stale in self._ctx.progress_dir.glob("rank*.json"):
            stale.unlink(missing_ok=True)
        self._ctx.notice_path.unlink(missing_ok=True)
        for ranks in assign_ranks(new, self._ctx.node_id):
            self._ctx.channel.assign(ranks.local_rank, Assignment(
                new.round, ranks.rank, ranks.world_size, ranks.local_world_size,
                ranks.group_rank, ranks.group_world_size, new.master_addr, new.master_port,
                new.restart_count))
        group.reassign(new, self._ctx.node_id)

    def depart(self, group: Workers, plan: Plan, bound_s: float) -> None:
        """This node leaves with notice; the others hold the same state: nothing to save.

        Why leave the rendezvous first: the others' next round waits for every live
        member, and a worker's process takes a while to end (torch's teardown). Our
        workers stop at the agreed boundary (the notice marker), or take the leave
        assignment written here if the others' pause is agreed first; past `bound_s`
        they are stopped."""
        started = time.monotonic()
        self._ctx.notice_path.touch()
        for local in range(len(group.pids)):
            self._ctx.channel.assign(local, Assignment(plan.round + 1, leave=True))
        self._ctx.rendezvous.leave()
        left = group.wait(bound_s)
        if not left:
            group.stop(self._ctx.stop_grace_s)
        waited = time.monotonic() - started
        log.info("left the run with notice; the workers %s", f"followed in {waited:.2f} s"
                 if left else f"did not stop within {bound_s:g} s and were stopped")
        self._ctx.events.emit("reform_left", round=plan.round + 1, inprocess=True,
                              stopped=not left, notice=True, waited_s=round(waited, 3))

    def _leave(self, group: Workers, new: Plan) -> None:
        """This node is not in `new`: its paused workers finish and exit."""
        for local in range(len(group.pids)):
            self._ctx.channel.assign(local, Assignment(new.round, leave=True))
        left = group.wait(self._ctx.bounds.leave_s)
        if not left:
            group.stop(self._ctx.stop_grace_s)
        log.info("this node is not in round %d: its workers %s", new.round,
                 "left" if left else f"did not leave within {self._ctx.bounds.leave_s:g} s "
                                     "and were stopped")
        self._ctx.events.emit("reform_left", round=new.round, inprocess=True, stopped=not left)

    # ---- waiting on the channel --------------------------------------------------
    def _wait(self, pending: Callable[[], list[int]], bound_s: float, what: str,
              past_bound: Callable[[], None] | None = None) -> None:
        """Until `pending()` is empty; past `bound_s`, `past_bound()` if given, else
        ReformFallback."""
        deadline = time.monotonic() + bound_s
        while True:
            if self._ctx.stop_requested.is_set():
                raise ShutdownRequested(f"shutdown requested while workers were to {what}")
            left = pending()
            if not left:
                return
            if time.monotonic() >= deadline:
                if past_bound is not None:
                    return past_bound()
                raise ReformFallback(f"worker local rank(s) {_ranks(left)} did not {what} "
                                     f"within {bound_s:g} s", tuple(left))
            self._ctx.stop_requested.wait(POLL_S)

    def _not_paused(self, group: Workers, number: int) -> list[int]:
        """Local ranks still to pause for round `number`; a failure raises."""
        exits = group.poll()  # before the states: a report written before an exit is seen
        states = self._ctx.channel.states()
        left = []
        for local, exit in enumerate(exits):
            state = states.get(local)
            _check_not_failed(local, state, "pause")
            if exit is not None:
                if exit.exit_code not in (0, EXIT_FOR_RESIZE):
                    raise ReformFallback(f"worker local rank {local} exited with code "
                                         f"{exit.exit_code} while pausing")
            elif not _in_round(state, number, (PAUSED,)):
                left.append(local)
        return left

    def _not_formed(self, group: Workers, number: int) -> list[int]:
        """Local ranks still to report TRAINING for round `number`; a failure raises.
        A worker that re-formed and then exited (its training done) counts as formed."""
        exits = group.poll()  # before the states: a report written before an exit is seen
        states = self._ctx.channel.states()
        left = []
        for local, exit in enumerate(exits):
            state = states.get(local)
            _check_not_failed(local, state, "re-form")
            if _in_round(state, number, (TRAINING, PAUSED)):
                continue
            if exit is not None:
                raise ReformFallback(f"worker local rank {local} exited with code "
                                     f"{exit.exit_code} before re-forming")
            left.append(local)
        return left

    def _announce(self, old: Plan, new: Plan, pause_s: float) -> None:
        self._ctx.events.emit("round_closed", **new.event_fields(), inprocess=True)
        self._ctx.events.emit("resize", round=new.round, old_world_size=old.world_size,
                              new_world_size=new.world_size, pause_s=round(pause_s, 3),
                              cause=new.cause, inprocess=True)
        log.info("re-formed in place: world size %d -> %d in %.2f s (round %d, restarts "
                 "%d/%d); workers kept their processes", old.world_size, new.world_size,
                 pause_s, new.round, new.restart_count, self._ctx.max_restarts)


def _holds_round(cause: Cause, plan: Plan) -> bool:
    """Whether `cause` may hold round `plan`'s collective in flight: a lost member of
    it (not a newcomer lost just after joining, which the round never had), a
    suspicion (a failed collective), or this node's own lease gone."""
    if cause.kind not in BROKEN_BY:
        return False
    if cause.kind is CauseKind.MEMBER_LOST and cause.detail:
        return bool(set(cause.detail.split(",")) & set(plan.node_ids))
    return True


def _check_not_failed(local: int, state: WorkerState | None, what: str) -> None:
    if state is not None and state.phase == FAILED:
        raise ReformFallback(f"worker local rank {local} could not {what}: "
                             f"{state.reason or 'it reported FAILED'}")


def _ranks(locals_: list[int]) -> str:
    return ", ".join(str(local) for local in locals_)
