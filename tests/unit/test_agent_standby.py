"""A joining node readies its workers on standby, and a node with notice leaves first
(issue 15, agent/standby.py and InProcessReform.depart), with no etcd and no processes
(the fakes: tests/helpers/reform_fakes.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from elastic_runner.contract import EXIT_FOR_RESIZE
from elastic_runner.errors import DuplicateNodeId
from elastic_runner.reform import STANDBY_ROUND, TRAINING, ReformChannel
from elastic_runner.rendezvous.protocol import Cause, CauseKind
from tests.helpers.reform_fakes import NODE, Behaviour, FakeGroup, Node, members

# ---- a joining node: workers on standby before it announces itself -----------------
JOIN_X = [members(("x", 2), (NODE, 2))]


def test_a_joining_node_readies_its_workers_before_registering_and_places_them(tmp_path):
    node = Node(tmp_path, JOIN_X, Behaviour(finish_round=0))
    node.rendezvous.in_place = True
    assert node.run() == 0
    assert node.journal[:4] == ["stand by", "start standby", "register", "round 0"]
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


def test_standby_workers_stop_when_the_node_cannot_register(tmp_path):
    """A second agent with our --node-id, found only once our workers were ready:
    the error is the agent's, and no standby worker outlives it."""
    node = Node(tmp_path, JOIN_X, Behaviour(finish_round=0))
    node.rendezvous.in_place = True
    node.rendezvous.refuse_registration = DuplicateNodeId("node id 'a' is already registered")
    assert node.run() == DuplicateNodeId.exit_code
    assert "already registered" in str(node.error)
    assert node.journal[:2] == ["stand by", "start standby"]
    assert "stop round--1 workers" in node.journal and "register" not in node.journal


@pytest.mark.parametrize("when", ["as-it-learns-the-run-is-in-place", "as-its-workers-start"])
def test_a_node_stopped_while_its_workers_get_ready_never_registers(tmp_path, when):
    """A spot node reclaimed seconds after it appeared (the g4dn replay has several):
    announced, it would cost the others a round opened for it and another without it."""
    node = Node(tmp_path, JOIN_X, Behaviour(finish_round=0))
    node.rendezvous.in_place = True

    def stop(*_) -> None:
        node.agent.request_stop(signal.SIGTERM)
    if when == "as-its-workers-start":
        node.on_start = stop
    else:
        node.rendezvous.on_stand_by = stop
    assert node.run() == 0  # SIGTERM, nothing of ours failed
    started = when == "as-its-workers-start"
    assert node.journal[:3] == (["stand by", "start standby", "stop round--1 workers"]
                                if started else ["stand by", "leave"])
    assert "register" not in node.journal and not node.rendezvous.issued
    assert node.journal[-1] == "leave"


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
