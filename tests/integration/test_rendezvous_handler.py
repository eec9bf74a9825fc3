"""EtcdRendezvous driven by threads against a real etcd: how arrivals become rounds."""

from __future__ import annotations

import threading
import time

from elastic_runner.config import EtcdConfig, RendezvousConfig
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.rendezvous.handler import EtcdRendezvous
from elastic_runner.rendezvous.protocol import JobSpec

SETTLE_S = 1.5


class Node:
    """One agent's rendezvous loop, without workers: join, then watch for changes."""

    def __init__(self, endpoint: str, run_id: str, node_id: str, max_nodes: int):
        self.client = EtcdClient(EtcdConfig((endpoint,), timeout_s=5.0, retry_deadline_s=10.0))
        config = RendezvousConfig(run_id, node_id, min_nodes=1, max_nodes=max_nodes,
                                  lease_ttl_s=5, settle_s=SETTLE_S, join_timeout_s=60)
        self.rdzv = EtcdRendezvous(self.client, config, JobSpec(1, max_nodes, "test"), 0)
        self.plans: list = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Node":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.rdzv.register()
            plan = self.rdzv.next_plan(None, "start")
            self.plans.append(plan)
            while not self._stop.is_set():
                generation = self.rdzv.mirror.generation
                reason = self.rdzv.change_reason(plan)
                if reason:
                    plan = self.rdzv.next_plan(plan, reason)
                    self.plans.append(plan)
                else:
                    self.rdzv.mirror.wait(0.1, generation)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            if not self._stop.is_set():
                self.error = exc

    def stop(self) -> None:
        self._stop.set()
        self.rdzv.shutdown.set()
        self.rdzv.mirror.wake()
        self._thread.join(timeout=10)
        self.rdzv.leave()
        self.client.close()


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


def test_a_burst_of_newcomers_costs_two_reformations_not_one_each(etcd):
    run = "burst"
    first = [Node(etcd.endpoint, run, f"a{i}", 16).start() for i in range(4)]
    newcomers = [Node(etcd.endpoint, run, f"b{i}", 16) for i in range(8)]
    try:
        start = wait_for_agreement(first, 4)
        for node in newcomers:  # 8 arrivals, 0.1 s apart: well inside one settle period
            node.start()
            time.sleep(0.1)
        plan = wait_for_agreement(first + newcomers, 12)
        # The first newcomer sees no recent arrival and opens a round at once; the
        # rest see it and wait for a quiet --settle, then share one more round.
        assert plan.round - start.round in (1, 2)
        assert [m.node_id for m in plan.members[:4]] == [m.node_id for m in start.members]
        assert sorted(m.first_rank for m in plan.members) == list(range(12))
    finally:
        for node in first + newcomers:
            node.stop()


def test_a_single_newcomer_and_a_leave_each_cost_one_round(etcd):
    run = "single"
    nodes = [Node(etcd.endpoint, run, f"n{i}", 8).start() for i in range(3)]
    try:
        start = wait_for_agreement(nodes, 3)
        newcomer = Node(etcd.endpoint, run, "late", 8).start()
        nodes.append(newcomer)
        grown = wait_for_agreement(nodes, 4)
        assert grown.round == start.round + 1
        assert grown.members[-1].node_id == "late"
        leaver = nodes.pop(1)
        leaver.stop()
        shrunk = wait_for_agreement(nodes, 3)
        assert shrunk.round == grown.round + 1
        assert leaver.rdzv.node_id not in shrunk.node_ids
    finally:
        for node in nodes:
            node.stop()


def test_a_slow_start_closes_once_when_arrivals_stop(etcd):
    """Nodes of one job booting over a few seconds end up in the first round together."""
    run = "staggered"
    nodes = []
    try:
        for i in range(6):
            nodes.append(Node(etcd.endpoint, run, f"s{i}", 16).start())
            time.sleep(0.3)
        plan = wait_for_agreement(nodes, 6)
        assert plan.round == 0
    finally:
        for node in nodes:
            node.stop()


def test_a_copy_that_missed_a_node_is_read_again_not_taken_for_a_loss(etcd):
    """A watch that dropped events must not tear down a running job."""
    run = "resync"
    nodes = [Node(etcd.endpoint, run, f"r{i}", 4).start() for i in range(2)]
    try:
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
    finally:
        for node in nodes:
            node.stop()
