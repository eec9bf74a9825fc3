"""In-process re-formation (issue 15), the agent's half, with no etcd and no processes.

Fake workers speak the real channel (reform.py) from threads, as an `@er.elastic`
worker would: they report TRAINING once formed, PAUSED when asked (or on their own
after a collective error), and TRAINING again once their Assignment arrives. A
scripted rendezvous hands out the rounds. The tests assert outcomes: which workers
were stopped, which ranks they were given, which events and calls the agent made.
Waits are on conditions with deadlines; the fakes poll the channel as workers do.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from elastic_runner.agent import reform_driver
from elastic_runner.agent.agent import Agent
from elastic_runner.agent.workers import WorkerExit
from tests.helpers.fake_workers import ExitQueries
from elastic_runner.config import AgentConfig, EtcdConfig, RendezvousConfig, WorkerConfig
from elastic_runner.contract import EXIT_FOR_RESIZE
from elastic_runner.errors import exit_code_for
from elastic_runner.reform import (
    COLLECTIVE_ERROR, FAILED, PAUSED, STANDBY, STANDBY_ROUND, TRAINING, Assignment,
    ReformChannel, WorkerState,
)
from elastic_runner.rendezvous.protocol import (
    Cause, CauseKind, Member, Plan, RankAssignment, assign_ranks,
)

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
        elif not self._wait(lambda: self.local not in b.never_pauses
                            and self.channel.pause_asked(self.round)
                            or b.exit_on_notice and self.notice.exists()):
            return -signal.SIGTERM
        elif b.exit_on_notice and self.notice.exists():
            time.sleep(0.05)  # a worker's teardown takes a while
            self.journal.append(f"worker {self.local} exits")
            return EXIT_FOR_RESIZE
        else:
            self.report(PAUSED, "asked")
        return self._re_form()

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
        self.in_place = False  # what runs_in_place answers

    def next_plan(self, previous: Plan | None, cause: Cause) -> Plan:
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
    def register(self) -> None: self.journal.append("register")
    def leave(self) -> None: self.journal.append("leave")
    def ping(self) -> None: ...
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
    def runs_in_place(self) -> bool: return self.in_place


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
        self.agent = Agent(config, self.rendezvous, EtcdConfig(), {}, self._start)

    def _start(self, plan, node_id, job, config, base_env, echo=True, error_dir=None):
        self.job = job
        self.journal.append(f"start round {plan.round}" if plan else "start standby")
        self.groups.append(FakeGroup(plan, job, self.behaviour, self.journal, config.nproc))
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
            return self.agent.run()
        except Exception as exc:
            self.error = exc
            return exit_code_for(exc)
        finally:
            for group in self.groups:
                group._end()

    def kinds(self, kind: str) -> list[dict]:
        return self.rendezvous.kinds(kind)


LOST_X = [members(("x", 2), (NODE, 2)), members((NODE, 2))]


@pytest.mark.parametrize("ttl, timeout", [(1, 10), (2, 10), (3, 12), (5, 20), (30, 120)])
def test_collective_timeout_is_four_ttls_and_at_least_ten_seconds(ttl, timeout):
    assert RendezvousConfig("run", "node", lease_ttl_s=ttl).collective_timeout_s == timeout


def test_workers_are_started_with_the_channel_folder_and_the_collective_timeout(tmp_path):
    node = Node(tmp_path, [members((NODE, 2))], Behaviour(finish_round=0))
    assert node.run() == 0
    assert Path(node.job.reform_dir).name == "reform"
    assert Path(node.job.reform_dir).parent == Path(node.job.notice_path).parent  # scratch
    assert node.job.collective_timeout_s == 10  # lease TTL 2 s: the 10 s floor


# ---- capable workers re-form in place --------------------------------------------
def test_capable_workers_are_paused_given_their_new_ranks_and_never_stopped(tmp_path):
    node = Node(tmp_path, LOST_X)
    node.rendezvous.change = Cause.member_lost(["x"])
    node.rendezvous.change_when = lambda: node.channel_shows(TRAINING, 0)
    assert node.run() == 0
    assert len(node.groups) == 1  # no fresh processes
    assert not [line for line in node.journal if line.startswith(("stop", "signal"))]
    workers = node.groups[0].workers
    assert [(a.round, a.rank, a.world_size, a.local_world_size, a.group_rank,
             a.group_world_size, a.master_port) for w in workers for a in w.assignments] == \
        [(1, 0, 2, 2, 0, 1, 29501), (1, 1, 2, 2, 0, 1, 29501)]
    assert [r.rank for r in node.groups[0].ranks] == [0, 1]  # were 2 and 3
    assert node.journal[-2:] == ["finish round 1", "leave"]
    started = node.kinds("reform_started")
    assert [(e["round"], e["reason"], e["inprocess"]) for e in started] == \
        [(0, "member-lost: x", True)]
    closed = node.kinds("round_closed")
    assert [(e["round"], e["world_size"], e.get("inprocess")) for e in closed] == \
        [(0, 4, None), (1, 2, True)]
    resize = node.kinds("resize")
    assert [(e["old_world_size"], e["new_world_size"], e["inprocess"]) for e in resize] == \
        [(4, 2, True)]
    assert not node.kinds("reform_fallback") and not node.kinds("workers_started")[1:]


def test_a_collective_error_is_reported_to_the_rendezvous_as_a_suspicion(tmp_path):
    node = Node(tmp_path, LOST_X, Behaviour(collective_error=(0,)))
    assert node.run() == 0
    assert [(number, cause.kind) for number, cause in node.rendezvous.suspected] == \
        [(0, CauseKind.MEMBER_SUSPECTED)]
    detail = node.rendezvous.suspected[0][1].detail
    assert detail.startswith(f"{NODE} local rank 0: {COLLECTIVE_ERROR}")
    assert node.rendezvous.causes[1].kind is CauseKind.MEMBER_SUSPECTED  # round 1's record
    assert len(node.groups) == 1 and not node.kinds("reform_fallback")


def test_a_peers_notice_re_forms_the_survivors_without_a_notice_file(tmp_path):
    node = Node(tmp_path, LOST_X)
    node.rendezvous.leaving = ["x"]
    node.rendezvous.leaving_when = lambda: node.channel_shows(TRAINING, 0)
    assert node.run() == 0
    assert [e["reason"] for e in node.kinds("reform_started")] == \
        [Cause(CauseKind.NOTICE, "x").text()]
    assert not any(w.saw_notice for w in node.groups[0].workers)  # they would have exited
    assert len(node.groups) == 1


def test_the_workers_leave_when_this_node_is_not_in_the_next_round(tmp_path):
    script = [members((NODE, 2), ("x", 2)), members(("x", 2)), members(("x", 2), (NODE, 2))]
    node = Node(tmp_path, script, Behaviour(finish_round=2))
    node.rendezvous.change = Cause(CauseKind.NEWCOMER)
    node.rendezvous.change_when = lambda: node.channel_shows(TRAINING, 0)
    assert node.run() == 0
    first = node.groups[0]
    assert [(a.round, a.leave) for w in first.workers for a in w.assignments] == \
        [(1, True), (1, True)]
    assert [w.code for w in first.workers] == [0, 0]  # they left, nobody stopped them
    assert "stop round-0 workers" not in node.journal
    assert [e["round"] for e in node.kinds("reform_left")] == [1]
    assert [g.round for g in node.groups] == [0, 2]  # back as a newcomer: fresh workers


# ---- the restart path -------------------------------------------------------------
@pytest.mark.parametrize("half_formed", [False, True], ids=["plain-script", "half-formed"])
def test_workers_that_are_not_all_capable_take_the_restart_path(tmp_path, half_formed):
    node = Node(tmp_path, LOST_X, Behaviour(reports=False))
    node.rendezvous.change = Cause.member_lost(["x"])
    if half_formed:  # local rank 0 reported TRAINING, local rank 1 has not yet
        node.rendezvous.change_when = lambda: _report_training(node, local_rank=0)
    assert node.run() == 0
    assert "stop round-0 workers" in node.journal
    assert [g.round for g in node.groups] == [0, 1]
    assert not node.kinds("reform_started") and not node.kinds("reform_fallback")
    assert node.kinds("member_lost")[0]["reason"] == "member-lost: x"


def _report_training(node: Node, local_rank: int) -> bool:
    """One worker's TRAINING report for round 0, written as the worker would."""
    if not node.groups:
        return False
    channel = ReformChannel(Path(node.job.reform_dir))
    channel.report(local_rank, WorkerState(0, TRAINING, 0, node.groups[0].pids[local_rank]))
    return True


@pytest.mark.parametrize("why, behaviour, script", [
    ("did not pause within 0.3 s", Behaviour(never_pauses=(1,)), LOST_X),
    ("could not re-form: could not create the process group",
     Behaviour(fail_on_assignment=True), LOST_X),
    ("round 1 gives this node 1 workers, it runs 2", Behaviour(),
     [members(("x", 2), (NODE, 2)), members((NODE, 1))]),
])
def test_a_failed_re_formation_falls_back_to_the_restart_path_once(tmp_path, monkeypatch, why,
                                                                   behaviour, script):
    # The pause bound is never below one collective timeout (10 s here): shorten both.
    monkeypatch.setattr(reform_driver.ReformBounds, "from_config", classmethod(
        lambda cls, config: cls(pause_s=0.3, form_s=10.0, leave_s=0.3)))
    node = Node(tmp_path, script, behaviour, pause_bound_s=0.3)
    node.rendezvous.change = Cause.member_lost(["x"])
    node.rendezvous.change_when = lambda: node.channel_shows(TRAINING, 0)
    assert node.run() == 0
    fallbacks = node.kinds("reform_fallback")
    assert len(fallbacks) == 1 and fallbacks[0]["round"] == 0
    assert why in fallbacks[0]["reason"]
    assert "stop round-0 workers" in node.journal
    assert [g.round for g in node.groups] == [0, 1]  # round 1 with fresh processes
    assert [e["round"] for e in node.kinds("workers_started")] == [0, 1]
    assert node.journal[-2:] == ["finish round 1", "leave"]


def test_a_signal_during_the_pause_stops_the_workers_and_the_node(tmp_path):
    node = Node(tmp_path, LOST_X, Behaviour(never_pauses=(0, 1)), pause_bound_s=30.0)
    node.rendezvous.change = Cause.member_lost(["x"])

    def interrupt_once_asked():  # the operator's Ctrl-C, once the agent asked for a pause
        pause = Path(node.job.reform_dir) / "pause.json"
        deadline = time.monotonic() + TEST_DEADLINE_S
        while not pause.exists() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        node.agent.request_stop(signal.SIGINT)

    def formed_then_interrupt() -> bool:
        if not node.channel_shows(TRAINING, 0):
            return False
        threading.Thread(target=interrupt_once_asked, daemon=True).start()
        return True

    node.rendezvous.change_when = formed_then_interrupt
    assert node.run() == 130  # not a 30 s wait for the pause bound
    assert "stop round-0 workers" in node.journal and node.journal[-1] == "leave"
    assert not node.kinds("reform_fallback") and len(node.groups) == 1


def test_the_pause_bound_outlasts_a_collective_timeout():
    """A worker blocked on a frozen peer pauses only when its collective gives up: the
    agent must still be waiting then, whatever the lease TTL."""
    for ttl, drain in ((2, 30.0), (5, 30.0), (10, 30.0), (30, 30.0)):
        rdzv = RendezvousConfig(run_id="unit", node_id=NODE, lease_ttl_s=ttl,
                                drain_timeout_s=drain)
        config = AgentConfig(rdzv, EtcdConfig(), WorkerConfig(argv=("t.py",), nproc=1,
                                                              fingerprint="f"))
        bounds = reform_driver.ReformBounds.from_config(config)
        assert bounds.pause_s >= drain
        assert bounds.pause_s > rdzv.collective_timeout_s


# ---- a joining node: workers on standby before it announces itself -----------------
JOIN_X = [members(("x", 2), (NODE, 2))]


def test_a_joining_node_readies_its_workers_before_registering_and_places_them(tmp_path):
    node = Node(tmp_path, JOIN_X, Behaviour(finish_round=0))
    node.rendezvous.in_place = True
    assert node.run() == 0
    assert node.journal[:3] == ["start standby", "register", "round 0"]
    assert len(node.groups) == 1  # the standby processes are the round's workers
    states = [w.assignments for w in node.groups[0].workers]
    assert [(a.round, a.rank, a.world_size, a.local_world_size, a.master_port)
            for got in states for a in got] == [(0, 2, 4, 2, 29500), (0, 3, 4, 2, 29500)]
    assert [r.rank for r in node.groups[0].ranks] == [2, 3]
    assert len(node.kinds("standby_ready")) == 1 and not node.kinds("standby_fallback")
    assert [e.get("standby") for e in node.kinds("workers_started")] == [True]
    assert node.rendezvous.marked == [0]  # capable once placed: it says so in turn


@pytest.mark.parametrize("behaviour, why", [
    (Behaviour(finish_round=0, standby_exit=3), "local rank 0 exited with code 3"),
    (Behaviour(finish_round=0, fail_on_assignment=True), "could not re-form"),
], ids=["exits-on-standby", "fails-to-take-its-place"])
def test_standby_workers_that_fail_are_replaced_by_fresh_ones(tmp_path, behaviour, why):
    node = Node(tmp_path, JOIN_X, behaviour)
    node.rendezvous.in_place = True
    assert node.run() == 0
    fallbacks = node.kinds("standby_fallback")
    assert len(fallbacks) == 1 and why in fallbacks[0]["reason"]
    assert [g.round for g in node.groups] == [STANDBY_ROUND, 0]  # then fresh workers
    assert node.journal[-2:] == ["finish round 0", "leave"]


def test_a_run_that_does_not_re_form_in_place_starts_no_standby_workers(tmp_path):
    node = Node(tmp_path, JOIN_X, Behaviour(finish_round=0))
    assert node.run() == 0
    assert node.journal[:3] == ["register", "round 0", "start round 0"]
    assert not node.kinds("standby_ready") and not node.kinds("standby_fallback")


@pytest.mark.parametrize("cause, paused_before_the_round", [
    (Cause(CauseKind.NEWCOMER, "y"), False),
    (Cause.member_lost(["x"]), True),
], ids=["newcomer", "member-lost"])
def test_workers_train_on_until_a_newcomers_round_closes(tmp_path, cause,
                                                         paused_before_the_round):
    """A newcomer costs the others a pause only once its round closed (its workers
    are ready by then); a lost member stops them at the next step boundary at once."""
    script = [members(("x", 2), (NODE, 2)), members(("x", 2), (NODE, 2), ("y", 1))]
    if cause.kind is CauseKind.MEMBER_LOST:
        script[1] = members((NODE, 2))
    node = Node(tmp_path, script)
    node.rendezvous.change = cause
    node.rendezvous.change_when = lambda: node.channel_shows(TRAINING, 0)
    pause_seen = []
    node.rendezvous.on_next_plan = lambda number: pause_seen.append(
        (number, node.groups != [] and (Path(node.job.reform_dir) / "pause.json").exists()))
    assert node.run() == 0
    assert pause_seen == [(0, False), (1, paused_before_the_round)]
    assert len(node.groups) == 1 and not node.kinds("reform_fallback")


def test_a_node_with_notice_leaves_the_run_before_its_in_place_workers_exit(tmp_path,
                                                                          monkeypatch):
    """The others hold the same state: nothing to save, and their next round must not
    wait for our processes to end. Our workers stop at the agreed boundary."""
    node = Node(tmp_path, [members((NODE, 2), ("x", 2))], Behaviour(exit_on_notice=True))
    seen: list = []  # the channel's assignments while the agent waits for its workers
    wait = FakeGroup.wait
    monkeypatch.setattr(FakeGroup, "wait", lambda group, timeout_s: seen.extend(
        ReformChannel(Path(node.job.reform_dir)).assignment(local) for local in (0, 1))
        or wait(group, timeout_s))

    def reclaimed_once_formed() -> bool:
        if node.channel_shows(TRAINING, 0):
            (tmp_path / "reclaim-notice").touch()  # --notice-file appears
        return False
    node.rendezvous.leaving_when = reclaimed_once_formed
    assert node.run() == 0
    assert node.journal.index("leave") < node.journal.index("worker 0 exits")
    assert not [line for line in node.journal if line.startswith(("stop", "signal"))]
    assert [w.code for w in node.groups[0].workers] == [EXIT_FOR_RESIZE] * 2
    left = node.kinds("reform_left")
    assert [(e["round"], e["notice"], e["stopped"]) for e in left] == [(1, True, False)]
    # Had the others' pause been agreed first, the workers would find their way out:
    assert [(a.round, a.leave) for a in seen] == [(1, True), (1, True)]

