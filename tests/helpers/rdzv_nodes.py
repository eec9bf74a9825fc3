"""Rendezvous agents as threads against a real etcd, without workers, for the
integration tests: one agent's loop (join, then watch for changes) and the waits
that turn "every node agrees" into a deadline rather than a sleep."""

from __future__ import annotations

import threading
import time

from elastic_runner.config import EtcdConfig, RendezvousConfig
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.engine import EtcdRendezvous
from elastic_runner.rendezvous.protocol import JobSpec

SETTLE_S = 1.5


def follow_rounds(rdzv: EtcdRendezvous, on_plan, stopping: threading.Event) -> None:
    """The agent's loop around a registered rendezvous, without workers: the first
    plan, then change_reason every 0.1 s (the agent's monitor tick) or on a change,
    and the next plan when the old one stops holding. `on_plan` returns the plan."""
    plan = on_plan(rdzv.next_plan(None, p.Cause(p.CauseKind.START)))
    while not stopping.is_set():
        marker = rdzv.change_marker()
        reason = rdzv.change_reason(plan)
        if reason:
            plan = on_plan(rdzv.next_plan(plan, reason))
        else:
            rdzv.wait_for_change(0.1, marker)


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
            follow_rounds(self.rdzv, self._admitted, self._stop)
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


def wait_for(condition, what: str, nodes: list[Node], timeout_s: float = 60) -> None:
    """Poll until `condition()` holds; fail on a node's error or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert not [n.error for n in nodes if n.error], [n.error for n in nodes if n.error]
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(0.02)


def arrive(newcomer: Node, observers: list[Node], key) -> None:
    """Start `newcomer`, then wait until a deputy among `observers` holds its `key`.
    A deputy's copy holds every key; another's holds no node or join keys at all
    (deputies.py), so which observer is a deputy decides, not the first in the list."""
    wanted = key(newcomer.rdzv.prefix, newcomer.rdzv.node_id)
    newcomer.start()
    wait_for(lambda: any(o.rdzv.mirror.wide and o.rdzv.mirror.get(wanted) is not None
                         for o in observers),
             f"a deputy to see {wanted}", [newcomer, *observers])


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


class Engines:
    """Unregistered EtcdRendezvous objects a test makes one by one; close_all() leaves
    and closes every one (a fixture's teardown)."""

    def __init__(self, spec: JobSpec, lease_ttl_s: int):
        self._spec, self._ttl = spec, lease_ttl_s
        self.made: list[EtcdRendezvous] = []

    def make(self, endpoint: str, run: str, node_id: str, **options) -> EtcdRendezvous:
        client = EtcdClient(EtcdConfig((endpoint,), timeout_s=5.0, retry_deadline_s=10.0))
        config = RendezvousConfig(run, node_id, max_nodes=4, lease_ttl_s=self._ttl,
                                  settle_s=0.2, **options)
        self.made.append(EtcdRendezvous(client, config, self._spec, 0))
        return self.made[-1]

    def close_all(self) -> None:
        for each in self.made:
            each.shutdown.set()
            each.leave()
            each._client.close()
