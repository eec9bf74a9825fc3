"""Which events a node copies to etcd for `status`, and under which lease (pure: a fake
client records the writes). Why it is selective: rendezvous/event_copy.py."""

from __future__ import annotations

import json

import pytest

from elastic_runner.errors import EtcdUnavailable, LeaseNotFound
from elastic_runner.rendezvous.event_copy import EVENT_TTL_S, EventCopy

class Recorder:
    def __init__(self):
        self.puts: list[tuple[str, dict, int]] = []
        self.grants = 0
        self.refuse_next_put = False

    def grant_lease(self, ttl_s: int) -> int:
        assert ttl_s == EVENT_TTL_S
        self.grants += 1
        return 100 + self.grants

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        if self.refuse_next_put:
            self.refuse_next_put = False
            raise LeaseNotFound("etcd no longer has the lease")
        self.puts.append((key, json.loads(value), lease))
        return len(self.puts)


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def copies(node: str, clock=None) -> tuple[EventCopy, Recorder]:
    client = Recorder()
    return EventCopy(client, "/r/", node, clock or Clock(), lambda: 1.7e9), client


def closed(number: int, *nodes: str) -> dict:
    return {"kind": "round_closed", "round": number, "world_size": len(nodes),
            "members": [{"node": n, "node_rank": i} for i, n in enumerate(nodes)]}


def test_a_rounds_outcome_is_copied_once_by_its_first_member_without_the_members():
    nodes = {name: copies(name) for name in ("a", "b", "c")}
    for copy, _ in nodes.values():
        copy.publish(closed(3, "b", "a", "c"))
        copy.publish({"kind": "resize", "round": 3, "old_world_size": 2, "new_world_size": 3})
    written = {name: [(e["kind"], e.get("members")) for _, e, _ in client.puts]
               for name, (_, client) in nodes.items()}
    assert written == {"a": [], "b": [("round_closed", None), ("resize", None)], "c": []}
    assert all(key.startswith("/r/events/") and key.endswith("-b")
               for key, _, _ in nodes["b"][1].puts)


def test_a_loss_is_copied_by_the_first_member_of_the_round_it_ended():
    a, to_a = copies("a")
    c, to_c = copies("c")
    for copy in (a, c):
        copy.publish(closed(4, "c", "a"))
        copy.publish(closed(5, "a", "c"))
        copy.publish({"kind": "member_lost", "round": 4, "reason": "member lost: b"})
    assert [e["kind"] for _, e, _ in to_c.puts] == ["round_closed", "member_lost"]
    assert [e["kind"] for _, e, _ in to_a.puts] == ["round_closed"]  # round 5's


def test_what_every_node_does_every_round_stays_local():
    copy, client = copies("a")
    copy.publish(closed(0, "a"))
    for kind in ("workers_started", "reform_started", "drain", "standby_ready"):
        copy.publish({"kind": kind, "round": 0})
    assert [e["kind"] for _, e, _ in client.puts] == ["round_closed"]


def test_a_nodes_own_events_share_one_lease_renewed_after_half_its_ttl():
    clock = Clock()
    copy, client = copies("a", clock)
    copy.publish({"kind": "joined", "addr": "10.0.0.1"})  # local: status reads the node key
    copy.publish({"kind": "notice", "round": 2})
    copy.publish({"kind": "worker_exited", "round": 2, "rank": 1})
    clock.now += EVENT_TTL_S / 2 + 1
    copy.publish({"kind": "finished"})
    assert [(e["kind"], lease) for _, e, lease in client.puts] == [
        ("notice", 101), ("worker_exited", 101), ("finished", 102)]
    assert client.grants == 2


def test_a_shared_lease_gone_under_us_is_replaced_once():
    copy, client = copies("a")
    copy.publish({"kind": "notice", "round": 1})
    client.refuse_next_put = True
    copy.publish({"kind": "etcd_lost"})
    assert [(e["kind"], lease) for _, e, lease in client.puts] == [("notice", 101),
                                                                   ("etcd_lost", 102)]
    client.refuse_next_put = True
    client.grant_lease = lambda ttl: (_ for _ in ()).throw(EtcdUnavailable("etcd is down"))
    with pytest.raises(EtcdUnavailable):  # the caller (EventLog.emit) logs and goes on
        copy.publish({"kind": "failed"})
