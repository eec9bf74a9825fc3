"""EtcdRendezvous driven by threads against a real etcd: how arrivals become rounds.

No sleep stands in for synchronisation: a test that needs an arrival to have
happened waits until etcd (as the first node's copy shows it) holds it, with a
generous deadline, so a slow machine makes a test slower, not wrong.
"""

from __future__ import annotations

import threading
import time

import pytest

from elastic_runner.config import EtcdConfig, RendezvousConfig
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.engine import EtcdRendezvous
from elastic_runner.rendezvous.protocol import JobSpec

SETTLE_S = 1.5


class Node:
    """One agent's rendezvous loop, without workers: join, then watch for changes.

    `clock`/`wall_clock` are the agent's own clocks (a test skews one agent's);
    `overrides` are RendezvousConfig fields. `admitted_at` holds, per plan, when it
    arrived on the test's clock.
    """

    def __init__(self, endpoint: str, run_id: str, node_id: str, max_nodes: int,
                 clock=time.monotonic, wall_clock=time.time, **overrides):
        self.client = EtcdClient(EtcdConfig((endpoint,), timeout_s=5.0, retry_deadline_s=10.0))
        config = RendezvousConfig(run_id, node_id, **{
            "min_nodes": 1, "max_nodes": max_nodes, "lease_ttl_s": 5, "settle_s": SETTLE_S,
            "join_timeout_s": 60, **overrides})
        self.rdzv = EtcdRendezvous(self.client, config,
                                   JobSpec(config.min_nodes, max_nodes, "test"), 0,
                                   clock=clock, wall_clock=wall_clock)
        self.plans: list = []
        self.admitted_at: list[float] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Node":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.rdzv.register()
            plan = self._admitted(self.rdzv.next_plan(None, p.Cause(p.CauseKind.START)))
            while not self._stop.is_set():
                generation = self.rdzv.mirror.generation
                reason = self.rdzv.change_reason(plan)
                if reason:
                    plan = self._admitted(self.rdzv.next_plan(plan, reason))
                else:
                    self.rdzv.mirror.wait(0.1, generation)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            if not self._stop.is_set():
                self.error = exc

    def _admitted(self, plan):
        self.admitted_at.append(time.monotonic())
        self.plans.append(plan)
        return plan

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self.rdzv.shutdown.set()
        self.rdzv.mirror.wake()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=10)
        self.rdzv.leave()
        self.client.close()


@pytest.fixture
def node(etcd):
    """Start a Node in run `run` (`begin=False`: only connect it); all are stopped after."""
    made: list[Node] = []

    def start(run: str, node_id: str, max_nodes: int, begin: bool = True, **options) -> Node:
        made.append(Node(etcd.endpoint, run, node_id, max_nodes, **options))
        return made[-1].start() if begin else made[-1]

    yield start
    for each in made:
        each.stop()


def wait_for(condition, what: str, nodes: list[Node], timeout_s: float = 60) -> None:
    """Poll until `condition()` holds; fail on a node's error or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert not [n.error for n in nodes if n.error], [n.error for n in nodes if n.error]
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(0.02)


def arrive(newcomer: Node, observer: Node, key) -> None:
    """Start `newcomer`, then wait until `observer`'s copy of etcd holds its `key`."""
    wanted = key(newcomer.rdzv.prefix, newcomer.rdzv.node_id)
    newcomer.start()
    wait_for(lambda: observer.rdzv.mirror.get(wanted) is not None,
             f"{observer.rdzv.node_id} to see {wanted}", [newcomer, observer])


def wait_for_agreement(nodes: list[Node], size: int, timeout_s: float = 60):
    """The plan every node holds once all hold the same one with `size` members."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert not [n.error for n in nodes if n.error], [n.error for n in nodes if n.error]
        newest = [n.plans[-1] if n.plans else None for n in nodes]
        if all(newest) and len({p.round for p in newest}) == 1 and \
                len(newest[0].members) == size:
            return newest[0]
        time.sleep(0.05)
    raise AssertionError(f"no agreement on {size} members: "
                         f"{[(n.plans[-1].round, len(n.plans[-1].members)) if n.plans else None for n in nodes]}")


def test_a_burst_of_newcomers_costs_two_reformations_not_one_each(node):
    first = [node("burst", f"a{i}", 16) for i in range(4)]
    start = wait_for_agreement(first, 4)
    # 8 arrivals one after another (connected beforehand, so each takes a few
    # requests): all well inside one settle period, yet each a distinct arrival.
    newcomers = [node("burst", f"b{i}", 16, begin=False) for i in range(8)]
    for newcomer in newcomers:
        arrive(newcomer, first[0], p.node_key)
    plan = wait_for_agreement(first + newcomers, 12)
    # The first newcomer sees no recent arrival and opens a round at once; the
    # rest see it and wait for a quiet --settle, then share one more round.
    assert plan.round - start.round in (1, 2)
    assert [m.node_id for m in plan.members[:4]] == [m.node_id for m in start.members]
    assert sorted(m.first_rank for m in plan.members) == list(range(12))


def test_a_single_newcomer_and_a_leave_each_cost_one_round(node):
    nodes = [node("single", f"n{i}", 8) for i in range(3)]
    start = wait_for_agreement(nodes, 3)
    nodes.append(node("single", "late", 8))
    grown = wait_for_agreement(nodes, 4)
    assert grown.round == start.round + 1
    assert grown.members[-1].node_id == "late"
    leaver = nodes.pop(1)
    leaver.stop()
    shrunk = wait_for_agreement(nodes, 3)
    assert shrunk.round == grown.round + 1
    assert leaver.rdzv.node_id not in shrunk.node_ids


def test_a_slow_start_closes_once_when_arrivals_stop(node):
    """Nodes of one job booting one after another end up in the first round together:
    each boots once the one before it has joined round 0."""
    nodes = [node("staggered", f"s{i}", 16, begin=False) for i in range(6)]
    for booting in nodes:
        arrive(booting, nodes[0], lambda prefix, node_id: p.join_key(prefix, 0, node_id))
    plan = wait_for_agreement(nodes, 6)
    assert plan.round == 0


def test_a_copy_that_missed_a_node_is_read_again_not_taken_for_a_loss(node):
    """A watch that dropped events must not tear down a running job."""
    nodes = [node("resync", f"r{i}", 4) for i in range(2)]
    plan = wait_for_agreement(nodes, 2)
    observer = nodes[0].rdzv
    other_key = f"{observer.prefix}nodes/r1"
    with observer.mirror._changed:  # as if the watch never delivered r1's registration
        observer.mirror._drop(other_key)
    assert observer.mirror.get(other_key) is None
    assert observer.change_reason(plan) is None
    assert observer.mirror.get(other_key) is not None
    assert observer.current_round().state.number == plan.round  # no round was opened
    assert all(n.plans[-1].round == plan.round for n in nodes)


def test_the_first_member_opens_at_once_for_a_lone_newcomer(node):
    """A newcomer cannot tell how old the node keys it found are, so its own rule
    waits --settle; the plan's first member saw every arrival and opens at once."""
    members = [node("lone", f"m{i}", 4, settle_s=0.5) for i in range(2)]
    before = wait_for_agreement(members, 2)
    arrived = time.monotonic()
    newcomer = node("lone", "new", 4, settle_s=30.0, settle_max_s=60.0)
    plan = wait_for_agreement(members + [newcomer], 3)
    assert plan.round == before.round + 1 and plan.cause == "newcomer"
    assert newcomer.admitted_at[0] - arrived < 30.0  # not the newcomer's own 30 s wait


def test_a_newcomer_opens_the_round_itself_when_the_first_member_does_not(node):
    members = [node("backup", f"m{i}", 4, settle_s=0.5) for i in range(2)]
    before = wait_for_agreement(members, 2)
    first = next(n for n in members if n.rdzv.node_id == before.members[0].node_id)
    first.rdzv.newcomers.members_wait = lambda plan: None  # as if it were hung
    newcomer = node("backup", "new", 4, settle_s=0.5)
    plan = wait_for_agreement(members + [newcomer], 3)
    assert plan.round == before.round + 1 and plan.cause == "newcomer"
