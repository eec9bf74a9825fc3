"""In-process re-formation (issue 15), the agent's half, with no etcd and no processes.

The fakes (tests/helpers/reform_fakes.py) speak the real channel from threads, as
`@er.elastic` workers would, and a scripted rendezvous hands out the rounds; joins on
standby and departures with notice are in test_agent_standby.py. The tests assert outcomes: which workers
were stopped, which ranks they were given, which events and calls the agent made.
Waits are on conditions with deadlines; the fakes poll the channel as workers do.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from elastic_runner.agent import reform_driver
from elastic_runner.config import AgentConfig, EtcdConfig, RendezvousConfig, WorkerConfig
from elastic_runner.reform import COLLECTIVE_ERROR, PAUSED, TRAINING, ReformChannel, WorkerState
from elastic_runner.rendezvous.protocol import Cause, CauseKind
from tests.helpers.reform_fakes import (
    NODE, POLL_S, TEST_DEADLINE_S, Behaviour, Node, RoundsAsSeen, bare_reform, members,
)

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


NEWCOMER_WITHOUT_X = [members(("x", 2), (NODE, 2)), members((NODE, 2), ("y", 2))]


def test_workers_held_by_a_member_gone_from_the_newcomers_round_are_cut(tmp_path, caplog):
    """x froze while a newcomer's round was open; the round closed without x once
    its lease went. The workers, held in a collective with x, reach no boundary:
    the agent cuts the round instead of waiting for x to thaw."""
    node = Node(tmp_path, NEWCOMER_WITHOUT_X, Behaviour(held_in_collective=(0, 1)))
    node.rendezvous.change = Cause(CauseKind.NEWCOMER)
    node.rendezvous.change_when = lambda: node.channel_shows(TRAINING, 0)
    started = time.monotonic()
    assert node.run() == 0
    assert time.monotonic() - started < 5.0  # the 1 s agreement wait, not the 10 s bound
    assert [r.getMessage() for r in caplog.records if "cutting" in r.getMessage()] == [
        "round 0 lost x while its workers paused for round 1; they reached no step "
        "boundary in time: cutting the round"]
    assert len(node.groups) == 1 and not node.kinds("reform_fallback")
    assert [a.round for w in node.groups[0].workers for a in w.assignments] == [1, 1]


def test_workers_held_by_a_member_lost_after_the_newcomers_round_closed_are_cut(tmp_path,
                                                                                caplog):
    """x is in the newcomer's round too: it froze just after that round closed, while
    the workers paused for it. They reach no boundary until x thaws; the agent cuts
    the round as soon as the rendezvous reports x lost (a chaos soak: 6.7 s without a
    step, the pause waiting out the whole freeze)."""
    script = [members(("x", 2), (NODE, 2)), members(("x", 2), (NODE, 2), ("y", 2))]
    node = Node(tmp_path, script, Behaviour(held_in_collective=(0, 1)))
    node.rendezvous.change = Cause(CauseKind.NEWCOMER)
    node.rendezvous.change_when = lambda: node.channel_shows(TRAINING, 0)

    def x_lost_once_round_1_closed(number: int) -> None:
        if number == 1:
            node.rendezvous.change = Cause.member_lost(["x"])
    node.rendezvous.on_next_plan = x_lost_once_round_1_closed
    started = time.monotonic()
    assert node.run() == 0
    assert time.monotonic() - started < 5.0  # not the pause bound (15 s here)
    assert [r.getMessage() for r in caplog.records if "cutting" in r.getMessage()] == [
        "round 0 lost a member while its workers paused for round 1 (member-lost: x): "
        "cutting the round"]
    assert len(node.groups) == 1 and not node.kinds("reform_fallback")


def test_workers_that_pause_at_the_boundary_are_not_cut_for_a_member_that_left(tmp_path,
                                                                              caplog):
    node = Node(tmp_path, NEWCOMER_WITHOUT_X)
    node.rendezvous.change = Cause(CauseKind.NEWCOMER)
    node.rendezvous.change_when = lambda: node.channel_shows(TRAINING, 0)
    assert node.run() == 0
    assert not [r for r in caplog.records if "cutting" in r.getMessage()]
    assert len(node.groups) == 1 and not node.kinds("reform_fallback")


@pytest.mark.parametrize("seen_first", [CauseKind.LEASE_EXPIRED, CauseKind.NEWCOMER],
                         ids=["its-lease-expired", "a-stale-newcomer"])
def test_a_node_back_from_a_freeze_rejoins_only_once_its_workers_left_their_round(
        tmp_path, seen_first):
    """Its lease expired while it was frozen; the others re-formed without it. Its
    workers are asked out of their round at once (cut), and the node joins the next
    round only when both have paused: joining first would make the others pause for
    a round these workers cannot form yet (chaos soaks: 6 s with three nodes paused).
    `a-stale-newcomer`: its monitor first saw a newcomer the others took in meanwhile,
    and next_plan found the lease gone (LeaseLost); registered at once, it held the
    others 15.6 s."""
    rejoined = [members(("x", 2), (NODE, 2)), members(("x", 2), (NODE, 2))]
    node = Node(tmp_path, rejoined, Behaviour(held_in_collective=(0, 1), pause_delay_s=0.5))
    node.rendezvous.change = Cause(seen_first)

    def thawed() -> bool:  # the change shows, and the lease is gone by then
        node.rendezvous.lease_gone = node.channel_shows(TRAINING, 0)
        return node.rendezvous.lease_gone
    node.rendezvous.change_when = thawed
    paused_when_joining = []
    node.rendezvous.on_next_plan = lambda number: paused_when_joining.append(
        (number, node.channel_shows(PAUSED, 0)))
    assert node.run() == 0
    assert ("lease lost" in node.journal) == (seen_first is CauseKind.NEWCOMER)
    assert paused_when_joining == [(0, False), (1, True)]
    assert node.rendezvous.causes[1].kind is CauseKind.LEASE_EXPIRED
    assert len(node.groups) == 1 and not node.kinds("reform_fallback")
    assert [a.round for w in node.groups[0].workers for a in w.assignments] == [1, 1]


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


@pytest.mark.parametrize("why, behaviour, script, stacks", [
    ("did not pause within 0.3 s", Behaviour(never_pauses=(1,)), LOST_X,
     ["stacks of round-0 local ranks [1]"]),
    ("could not re-form: could not create the process group",
     Behaviour(fail_on_assignment=True), LOST_X, []),
    ("round 1 gives this node 1 workers, it runs 2", Behaviour(),
     [members(("x", 2), (NODE, 2)), members((NODE, 1))], []),
])
def test_a_failed_re_formation_falls_back_to_the_restart_path_once(tmp_path, monkeypatch, why,
                                                                   behaviour, script, stacks):
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
    # A worker that did not pause writes its stacks to its log before it is stopped.
    stop = node.journal.index("stop round-0 workers")
    assert [e for e in node.journal[:stop] if e.startswith("stacks")] == stacks
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


def _forming_watch(tmp_path: Path, rendezvous: RoundsAsSeen):
    from elastic_runner.rendezvous.protocol import Plan

    reform, channel = bare_reform(tmp_path, rendezvous)
    new = Plan(4, members(("x", 1), (NODE, 1)), "127.0.0.1", 29504, 0, "member-lost")
    return reform.forming_watch(new), channel


@pytest.mark.parametrize("cause, notices, calls_off", [
    (None, (), False),
    (Cause(CauseKind.NEWCOMER), (), False),  # forms, and takes the newcomer in afterwards
    (Cause.member_lost(("x",)), (), True),
    (None, ("x",), True),  # a member of the new round announced its departure
    (None, (NODE,), False),  # our own notice: this node's own departure handles it
])
def test_a_round_that_loses_a_member_while_forming_is_called_off(tmp_path, cause, notices,
                                                                 calls_off):
    rendezvous = RoundsAsSeen(cause, notices)
    watch, channel = _forming_watch(tmp_path, rendezvous)
    assert watch.check([0]) == [0]
    assert channel.pause_asked(4) is calls_off
    assert (watch.seen is not None) is calls_off
    watch._next_look = 0.0
    watch.check([0])  # once called off, the rendezvous is not asked again
    assert rendezvous.asked == (1 if calls_off else 2)


@pytest.mark.parametrize("cause, cuts", [
    (None, False),
    (Cause(CauseKind.NEWCOMER), False),  # a third node: it joins the round after this one
    (Cause.member_lost(("x",)), True),  # in the round being left: it holds its collective
    (Cause.member_lost(("y",)), False),  # only in the next round: the boundary still comes
    (Cause.member_suspected(f"{NODE} local rank 0", "collective-error"), True),
    (Cause(CauseKind.LEASE_EXPIRED), True),  # this node froze: its own round is over
])
def test_a_graceful_pause_is_cut_only_for_a_loss_that_holds_its_round(tmp_path, cause, cuts):
    from elastic_runner.rendezvous.protocol import Plan

    # x's notice is no reason either: the boundary comes, then x leaves at it.
    reform, channel = bare_reform(tmp_path, RoundsAsSeen(cause, notices=("x",)))
    plan = Plan(3, members(("x", 1), (NODE, 1)), "127.0.0.1", 29503, 0, "start")
    new = Plan(4, members(("x", 1), (NODE, 1), ("y", 1)), "127.0.0.1", 29504, 0, "newcomer")
    watch = reform.pausing_watch(plan, new)
    assert watch.check([0, 1]) == [0, 1]
    assert channel.broken(3) is cuts
    assert not channel.pause_asked(4)


def test_a_formed_round_is_not_looked_at(tmp_path):
    rendezvous = RoundsAsSeen(Cause.member_lost(("x",)))
    watch, channel = _forming_watch(tmp_path, rendezvous)
    assert watch.check([]) == []
    assert rendezvous.asked == 0 and not channel.pause_asked(4)
