"""Workers whose group er.init() deferred (agent/deferred.py), the agent's half.

With no etcd and no processes: the fake workers (tests/helpers/reform_fakes.py) report
DEFERRED, then STANDBY once their script is "ready", and take the place the agent
writes them. The tests assert which rounds the agent joined, which places the workers
got, that nobody was stopped, and the events.
"""

from __future__ import annotations

import signal

import pytest

from elastic_runner.agent.deferred import READY, WAITING, waiting_for_place
from elastic_runner.reform import (
    DEFERRED, PAUSED, STANDBY, STANDBY_ROUND, TRAINING, WorkerState,
)
from elastic_runner.rendezvous.protocol import Cause, CauseKind
from tests.helpers.reform_fakes import (
    NODE, Behaviour, Node, RoundsAsSeen, bare_reform, members,
)


def _places(node: Node) -> list[tuple[int, int, int]]:
    return [(a.round, a.rank, a.world_size) for w in node.groups[0].workers
            for a in w.assignments]


def _stops(node: Node) -> list[str]:
    return [line for line in node.journal if line.startswith(("stop", "signal"))]


@pytest.mark.parametrize("change, script, places", [
    (Cause.member_lost(["x"]), [members(("x", 2), (NODE, 2)), members((NODE, 2))],
     [(1, 0, 2), (1, 1, 2)]),
    (Cause(CauseKind.NEWCOMER), [members((NODE, 2)), members((NODE, 2), ("y", 2))],
     [(1, 0, 4), (1, 1, 4)]),
    (Cause(CauseKind.NOTICE, "x"), [members(("x", 2), (NODE, 2)), members((NODE, 2))],
     [(1, 0, 2), (1, 1, 2)]),
], ids=["member-lost", "newcomer", "notice"])
def test_a_change_while_the_workers_get_ready_is_followed_without_a_restart(
        tmp_path, change, script, places):
    node = Node(tmp_path, script, Behaviour(defers=True, finish_round=1))
    node.behaviour.ready_when = lambda: len(node.rendezvous.issued) == 2
    node.rendezvous.change = change
    node.rendezvous.change_when = lambda: node.channel_shows(DEFERRED, STANDBY_ROUND)
    assert node.run() == 0
    assert len(node.groups) == 1 and not _stops(node)  # the same processes throughout
    assert _places(node) == places  # their first place: the round followed, not round 0
    closed = node.kinds("round_closed")
    assert [(e["round"], e.get("deferred")) for e in closed] == [(0, None), (1, True)]
    assert node.rendezvous.marked == [0]  # newcomers start on standby from now on
    assert not node.kinds("reform_fallback") and not node.kinds("standby_fallback")
    assert node.journal[-2:] == ["finish round 1", "leave"]


def test_ready_workers_take_their_places_in_the_round_they_were_started_in(tmp_path):
    node = Node(tmp_path, [members(("x", 2), (NODE, 2))], Behaviour(defers=True,
                                                                    finish_round=0))
    assert node.run() == 0
    assert _places(node) == [(0, 2, 4), (0, 3, 4)]
    assert len(node.groups) == 1 and not _stops(node)
    assert node.rendezvous.causes == [Cause(CauseKind.START)]  # no round but the first


def test_a_node_left_out_of_the_round_it_followed_stops_its_workers_and_rejoins(tmp_path):
    script = [members((NODE, 2), ("x", 2)), members(("x", 2)), members(("x", 2), (NODE, 2))]
    node = Node(tmp_path, script, Behaviour(defers=True, finish_round=2))
    node.behaviour.ready_when = lambda: len(node.rendezvous.issued) == 3
    node.rendezvous.change = Cause(CauseKind.NEWCOMER)
    node.rendezvous.change_when = lambda: node.channel_shows(DEFERRED, STANDBY_ROUND)
    assert node.run() == 0
    assert "stop round-0 workers" in node.journal
    assert [g.round for g in node.groups] == [0, 2]  # fresh workers for the round after
    assert [(a.round, a.rank) for w in node.groups[1].workers for a in w.assignments] == \
        [(2, 2), (2, 3)]


def test_a_signal_while_the_agent_follows_a_round_stops_the_workers_and_the_node(tmp_path):
    """The operator's Ctrl-C while the agent waits for the round it follows: the
    rendezvous ends its wait (ShutdownRequested), and no worker outlives its agent."""
    from elastic_runner.errors import ShutdownRequested

    node = Node(tmp_path, [members(("x", 2), (NODE, 2)), members((NODE, 2))],
                Behaviour(defers=True, ready_when=lambda: False))
    node.rendezvous.change = Cause.member_lost(["x"])
    node.rendezvous.change_when = lambda: node.channel_shows(DEFERRED, STANDBY_ROUND)

    def interrupted(number: int) -> None:
        if number == 1:
            node.agent.request_stop(signal.SIGINT)
            raise ShutdownRequested("a signal arrived during the rendezvous")

    node.rendezvous.on_next_plan = interrupted
    assert node.run() == 130
    assert "stop round-0 workers" in node.journal and node.journal[-1] == "leave"
    assert len(node.groups) == 1 and all(w.done.is_set() for w in node.groups[0].workers)


def test_workers_without_the_runtime_keep_the_restart_path(tmp_path):
    """A script that never reports (no er.init(defer_group=True)): a change while it
    starts stops it, as before."""
    script = [members(("x", 2), (NODE, 2)), members((NODE, 2))]
    node = Node(tmp_path, script, Behaviour(reports=False, finish_round=1))
    node.rendezvous.change = Cause.member_lost(["x"])
    assert node.run() == 0
    assert "stop round-0 workers" in node.journal
    assert [g.round for g in node.groups] == [0, 1]


def _state(phase: str, round_number: int = STANDBY_ROUND) -> WorkerState:
    return WorkerState(round_number, phase, -1, 1)


@pytest.mark.parametrize("states, expected", [
    ({0: _state(DEFERRED), 1: _state(DEFERRED)}, WAITING),
    ({0: _state(DEFERRED), 1: _state(STANDBY)}, WAITING),
    ({0: _state(STANDBY), 1: _state(STANDBY)}, READY),
    ({0: _state(STANDBY)}, None),  # local rank 1 has not reported: maybe no runtime
    ({0: _state(STANDBY), 1: _state(TRAINING, 0)}, None),  # in a group already
    ({0: _state(PAUSED, 3), 1: _state(PAUSED, 3)}, None),  # re-forming in place
    ({}, None),
])
def test_workers_wait_for_a_place_only_when_every_one_of_them_said_so(states, expected):
    assert waiting_for_place(states, 2) == expected


def test_no_workers_wait_for_nothing():
    assert waiting_for_place({}, 0) is None
    assert waiting_for_place({}, 0, they_defer=True) is None


def test_once_its_workers_deferred_the_agent_counts_fresh_ones_as_on_their_way(tmp_path):
    """Same script, same choice: a worker of a later start not heard from yet (Python,
    import torch) will defer its group too, so a change then is followed."""
    from elastic_runner.agent.deferred import DeferredWorkers
    from elastic_runner.reform import ReformChannel
    from elastic_runner.rendezvous.protocol import Plan

    channel, marked = ReformChannel(tmp_path / "reform"), []
    workers = DeferredWorkers(channel, marked.append)
    plan = Plan(5, members((NODE, 2)), "127.0.0.1", 29505)
    assert workers.waiting(2, plan) is None  # nothing heard, nothing known: restart path
    channel.report(0, _state(DEFERRED))
    assert workers.waiting(2, plan) == WAITING  # local rank 1 runs the same script
    channel.report(0, _state(STANDBY))
    channel.report(1, _state(STANDBY))
    assert workers.waiting(2, plan) == READY
    channel.reset()  # a restart: fresh workers, nothing reported yet
    assert workers.waiting(2, plan) == WAITING
    channel.report(1, _state(TRAINING, 6))  # a place taken: no longer waiting
    assert workers.waiting(2, plan) is None
    assert marked == [5, 5, 5]


@pytest.mark.parametrize("deferred", [False, True])
def test_a_newcomer_calls_off_a_first_group_only_where_it_was_deferred(tmp_path, deferred):
    """Members that re-formed are all ready: their group forms within moments, and
    takes the newcomer in afterwards. A deferred first group waits for every member's
    script to reach its training function; members still on their way follow the
    newcomer's round at once, so this one would wait out its formation timeout."""
    from elastic_runner.rendezvous.protocol import Plan

    reform, channel = bare_reform(tmp_path, RoundsAsSeen(Cause(CauseKind.NEWCOMER)))
    new = Plan(4, members(("x", 1), (NODE, 1)), "127.0.0.1", 29504, 0, "start")
    watch = reform.forming_watch(new, newcomers=deferred)
    assert watch.check([0]) == [0]
    assert channel.pause_asked(4) is deferred
