"""Fakes for the agent's in-process re-formation tests (no etcd, no processes).

Fake workers speak the real channel (reform.py) from threads, as an `@er.elastic`
worker would: they report TRAINING once formed, PAUSED when asked (or on their own
after a collective error), STANDBY when started before their node joined, and
TRAINING again once their Assignment arrives. A scripted rendezvous hands out the
rounds; `Node` wires one agent to them.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from elastic_runner.agent.agent import Agent
from elastic_runner.agent.workers import WorkerExit
from tests.helpers.fake_workers import ExitQueries, run_as_the_cli
from elastic_runner.config import AgentConfig, EtcdConfig, RendezvousConfig, WorkerConfig
from elastic_runner.contract import EXIT_FOR_RESIZE
from elastic_runner.errors import LeaseLost
from elastic_runner.reform import (
    COLLECTIVE_ERROR, DEFERRED, FAILED, PAUSED, STANDBY, STANDBY_ROUND, TRAINING, Assignment,
    ReformChannel, WorkerState,
)
from elastic_runner.rendezvous.protocol import Cause, Member, Plan
from elastic_runner.rendezvous.ranks import RankAssignment, assign_ranks


NODE = "a"
TEST_DEADLINE_S = 30.0  # a run that takes longer is stuck: fail instead of hanging
POLL_S = 0.002  # how often a fake worker reads the channel


def members(*nodes: tuple[str, int]) -> tuple[Member, ...]:
    """Members in rank order from (node, nproc) pairs."""
    out, first = [], 0
    for rank, (node, nproc) in enumerate(nodes):
        out.append(Member(node, rank, nproc, "127.0.0.1", first))
        first += nproc
    return tuple(out)


# ---- the fakes --------------------------------------------------------------------
@dataclass
class Behaviour:
    """How every worker of the job behaves (local rank -> exception where it differs)."""

    reports: bool = True  # speaks the channel (False: a plain script)
    finish_round: int = 1  # exits 0 once it trains in this round
    never_pauses: tuple[int, ...] = ()  # local ranks that ignore ask_pause
    collective_error: tuple[int, ...] = ()  # local ranks that pause on their own in round 0
    fail_on_assignment: bool = False  # report FAILED (and exit 1) instead of re-forming
    standby_exit: int | None = None  # a standby worker exits with this before it is ready
    exit_on_notice: bool = False  # a notice marker makes it exit 75 (its node leaves)
    # Local ranks held in round 0's collective by a frozen peer: they reach no step
    # boundary, and pause only once the agent cuts the round (a broken pause request).
    held_in_collective: tuple[int, ...] = ()
    # Seconds a worker asked to pause takes before it reports PAUSED (a thawed worker
    # still in its old round's collective).
    pause_delay_s: float = 0.0
    # er.init(defer_group=True): a worker started in a round reports DEFERRED, then
    # STANDBY once `ready_when()` (its script reached the training function).
    defers: bool = False
    ready_when: Callable[[], bool] = lambda: True


class FakeWorker(threading.Thread):
    """One worker process, as a thread that talks to the agent through the channel."""

    def __init__(self, channel: ReformChannel, round_number: int, local_rank: int,
                 behaviour: Behaviour, notice: Path, pid: int, journal: list[str]):
        super().__init__(daemon=True)
        self.journal = journal
        self.channel, self.round, self.local = channel, round_number, local_rank
        self.behaviour, self.notice, self.pid = behaviour, notice, pid
        self.code: int | None = None
        self.assignments: list[Assignment] = []
        self.saw_notice = False
        self.stopping = threading.Event()
        self.done = threading.Event()

    def report(self, phase: str, reason: str = "") -> None:
        self.channel.report(self.local, WorkerState(self.round, phase, 7, self.pid, reason))

    def run(self) -> None:
        try:
            self.code = self._live()
        finally:
            self.done.set()

    def _live(self) -> int:
        b = self.behaviour
        if b.defers and self.round != STANDBY_ROUND and not self.assignments:
            self.round = STANDBY_ROUND  # no group: er.elastic takes its first place
            self.report(DEFERRED)
            if not self._wait(b.ready_when):
                return -signal.SIGTERM
        if self.round == STANDBY_ROUND:
            if b.standby_exit is not None:
                return b.standby_exit
            self.report(STANDBY)
            return self._re_form()
        if not b.reports:
            return 0 if self.round >= b.finish_round else self._until_stopped()
        self.report(TRAINING)
        if self.round >= b.finish_round:
            return 0
        if self.round == 0 and self.local in b.collective_error:
            self.report(PAUSED, f"{COLLECTIVE_ERROR}: connection reset by peer")
        elif not self._wait(lambda: self._asked_to_pause()
                            or b.exit_on_notice and self.notice.exists()):
            return -signal.SIGTERM
        elif self.round == 0 and self.local in b.held_in_collective:
            time.sleep(b.pause_delay_s)
            self.report(PAUSED, f"{COLLECTIVE_ERROR}: connection closed (the round was cut)")
        elif b.exit_on_notice and self.notice.exists():
            time.sleep(0.05)  # a worker's teardown takes a while
            self.journal.append(f"worker {self.local} exits")
            return EXIT_FOR_RESIZE
        else:
            self.report(PAUSED, "asked")
        return self._re_form()

    def _asked_to_pause(self) -> bool:
        if self.local in self.behaviour.never_pauses:
            return False
        if self.round == 0 and self.local in self.behaviour.held_in_collective:
            return self.channel.broken(self.round)
        return self.channel.pause_asked(self.round)

    def _re_form(self) -> int:
        got = self._wait(lambda: self._assignment())
        if not got:
            return -signal.SIGTERM
        assignment = self.assignments[-1]
        if assignment.leave:
            return 0
        if self.behaviour.fail_on_assignment:
            self.report(FAILED, "could not create the process group")
            return 1
        self.round = assignment.round
        return self._live()

    def _assignment(self) -> bool:
        found = self.channel.assignment(self.local)
        if found is None or found.round <= self.round:
            return False
        self.assignments.append(found)
        return True

    def _until_stopped(self) -> int:
        self.stopping.wait()
        return -signal.SIGTERM

    def _wait(self, condition) -> bool:
        """Poll like a paused worker; False once stopped."""
        while not self.stopping.is_set():
            self.saw_notice = self.saw_notice or self.notice.exists()
            if condition():
                return True
            self.stopping.wait(POLL_S)
        return False


class FakeGroup(ExitQueries):
    """One node's workers of one fresh start (the Workers port)."""

    pids_from = itertools.count(1000, 10)

    def __init__(self, plan: Plan | None, job, behaviour: Behaviour, journal: list[str],
                 nproc: int):
        self.ranks = (assign_ranks(plan, NODE) if plan is not None else
                      [RankAssignment(-1, local, 0, nproc, -1, 0) for local in range(nproc)])
        self.round = plan.round if plan is not None else STANDBY_ROUND
        self.journal = journal
        channel = ReformChannel(Path(job.reform_dir))
        base = next(self.pids_from)
        self.workers = [FakeWorker(channel, self.round, r.local_rank, behaviour,
                                   Path(job.notice_path), base + r.local_rank, journal)
                        for r in self.ranks]
        for worker in self.workers:
            worker.start()

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def poll(self) -> list[WorkerExit | None]:
        return [WorkerExit(r.rank, r.local_rank, w.code, 0.0, [], None) if w.done.is_set()
                else None for r, w in zip(self.ranks, self.workers)]

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all(w.done.wait(max(0.0, deadline - time.monotonic())) for w in self.workers)

    def dump_stacks(self, local_ranks) -> None:
        self.journal.append(f"stacks of round-{self.round} local ranks {list(local_ranks)}")

    def signal_all(self, signum: int) -> None:
        self.journal.append(f"signal round-{self.round} workers")
        self._end()

    def stop(self, grace_s: float) -> None:
        self.journal.append(f"stop round-{self.round} workers")
        self._end()

    def _end(self) -> None:
        for worker in self.workers:
            worker.stopping.set()
        for worker in self.workers:
            worker.done.wait(5.0)

    def reassign(self, plan: Plan, node_id: str) -> None:
        self.ranks = assign_ranks(plan, node_id)
        self.journal.append(f"reassign round {plan.round}")


class ScriptedRendezvous:
    """Rounds from a script of member lists; the plan of round r is `script[r]`.

    `next_plan` behaves as the engine's: a closed round after `previous` that
    includes this node is returned (again, if need be); otherwise the next one
    opens. `change` is returned once by `change_reason`, as soon as `change_when()`.
    """

    def __init__(self, script: list[tuple[Member, ...]], journal: list[str]):
        self.script = script
        self.journal = journal
        self.issued: list[Plan] = []
        self.causes: list[Cause] = []
        self.events: list[dict] = []
        self.suspected: list[tuple[int, Cause]] = []
        self.change: Cause | None = None
        self.change_when = lambda: True
        self.leaving: list[str] = []
        self.leaving_when = lambda: True
        self._woken = threading.Event()
        self._deadline = time.monotonic() + TEST_DEADLINE_S
        self.marked: list[int] = []  # rounds in which mark_in_place was called
        self.on_next_plan = lambda number: None  # just before round `number` is issued
        self.in_place = False  # the run is marked as re-forming in place (register)
        self.refuse_registration: Exception | None = None  # raised by a plain register()
        self.on_stand_by = lambda: None  # as register() answers that the run is in place
        self.lease_gone = False  # found by next_plan: LeaseLost where rejoin=False

    def next_plan(self, previous: Plan | None, cause: Cause, rejoin: bool = True) -> Plan:
        if self.lease_gone and not rejoin:  # the engine: LeaseLost rather than register
            self.journal.append("lease lost")
            raise LeaseLost("the lease is gone")
        self.lease_gone = False  # registered again, with a new lease
        last = self.issued[-1] if self.issued else None
        if last is not None and previous is not None and last.round > previous.round \
                and last.member(NODE):
            return last
        number = len(self.issued)
        if number >= len(self.script):
            raise AssertionError(f"round {number} is not in the script")
        self.causes.append(cause)
        self.on_next_plan(number)
        plan = Plan(number, self.script[number], "127.0.0.1", 29500 + number,
                    cause=cause.text())
        self.issued.append(plan)
        self.journal.append(f"round {number}")
        return plan

    def change_reason(self, plan: Plan) -> Cause | None:
        if self.change is not None and self.change_when():
            change, self.change = self.change, None
            return change
        return None

    def notices(self, plan: Plan) -> list[str]:
        return list(self.leaving) if self.leaving_when() else []

    def suspect(self, plan: Plan, cause: Cause) -> None:
        self.suspected.append((plan.round, cause))

    def wait_for_change(self, timeout_s: float, since: int) -> bool:
        if time.monotonic() > self._deadline:
            raise AssertionError(f"the agent ran for {TEST_DEADLINE_S} s")
        return self._woken.wait(timeout_s)

    def publish_event(self, record: dict) -> None:
        self.events.append(record)

    def kinds(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind]

    # the rest of the port: nothing to script
    def register(self, unless_in_place: bool = False) -> bool:
        if unless_in_place and self.in_place:
            self.journal.append("stand by")
            self.on_stand_by()
            return False
        if self.refuse_registration is not None:
            raise self.refuse_registration
        self.journal.append("register")
        return True

    def leave(self) -> None: self.journal.append("leave")
    def ping(self, write: bool = False) -> None: ...
    def etcd_answers_now(self) -> bool: return True
    def current_round(self): return None
    def report_failure(self, number: int, failure: dict) -> None: ...
    def give_notice(self, round_number: int) -> None: ...
    def finish(self, plan: Plan) -> None: self.journal.append(f"finish round {plan.round}")
    def change_marker(self) -> int: return 0
    def wake(self) -> None: self._woken.set()
    def interrupt(self) -> None: ...
    def seconds_since_etcd_answered(self) -> float: return 0.0

    # in-place capability, as the engine keeps it in etcd
    def mark_in_place(self, round_number: int) -> None: self.marked.append(round_number)

    def origin(self) -> str: return "fake-origin"


class Node:
    """One agent (node "a", 2 workers) wired to the fakes."""

    def __init__(self, tmp_path: Path, script: list[tuple[Member, ...]],
                 behaviour: Behaviour | None = None, pause_bound_s: float = 10.0):
        self.journal: list[str] = []
        self.rendezvous = ScriptedRendezvous(script, self.journal)
        self.behaviour = behaviour or Behaviour()
        self.groups: list[FakeGroup] = []
        rdzv = RendezvousConfig(run_id="unit", node_id=NODE, lease_ttl_s=2,
                                drain_timeout_s=pause_bound_s)
        workers = WorkerConfig(argv=("train.py",), nproc=2, fingerprint="f", stop_grace_s=0.0,
                               monitor_interval_s=0.005)
        config = AgentConfig(rdzv, EtcdConfig(), workers, max_restarts=0, verbosity=0,
                             notice_file=tmp_path / "reclaim-notice")
        self.on_start = lambda plan: None  # just after workers start (plan None: standby)
        self.agent = Agent(config, self.rendezvous, EtcdConfig(), {}, self._start)

    def _start(self, plan, node_id, job, config, base_env, echo=True, error_dir=None):
        self.job = job
        self.journal.append(f"start round {plan.round}" if plan else "start standby")
        self.groups.append(FakeGroup(plan, job, self.behaviour, self.journal, config.nproc))
        self.on_start(plan)
        return self.groups[-1]

    def channel_shows(self, phase: str, round_number: int) -> bool:
        """Every worker of the first start reported `phase` for `round_number`."""
        if not self.groups:
            return False
        states = ReformChannel(Path(self.job.reform_dir)).states()
        return all((s := states.get(w.local)) is not None and s.phase == phase
                   and s.round == round_number for w in self.groups[0].workers)

    def run(self) -> int:
        try:
            code, self.error = run_as_the_cli(self.agent)
            return code
        finally:
            for group in self.groups:
                group._end()

    def kinds(self, kind: str) -> list[dict]:
        return self.rendezvous.kinds(kind)


# ---- one InProcessReform on its own (the watches), without an agent ------------------
class RoundsAsSeen:
    """The two questions a round's watch asks the rendezvous, scripted."""

    def __init__(self, cause: Cause | None = None, notices: tuple[str, ...] = ()):
        self.cause, self.leaving, self.asked = cause, list(notices), 0

    def change_reason(self, plan):
        self.asked += 1
        return self.cause

    def notices(self, plan):
        return self.leaving


def bare_reform(tmp_path: Path, rendezvous: RoundsAsSeen):
    """An InProcessReform on `rendezvous` alone, and its channel."""
    from elastic_runner.agent import reform_driver

    channel = ReformChannel(tmp_path / "reform")
    context = reform_driver.ReformContext(
        channel=channel, rendezvous=rendezvous, events=None, node_id=NODE, bounds=None,
        stop_requested=threading.Event(), stop_grace_s=1.0, max_restarts=1,
        progress_dir=tmp_path, notice_path=tmp_path / "notice")
    return reform_driver.InProcessReform(context), channel
