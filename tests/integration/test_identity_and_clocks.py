"""Issue 12, item 4, against a real etcd.

A node id is held by one live agent at a time (create-if-absent under its
lease); a second live agent with the same id is refused with DuplicateNodeId, a
crashed one's id is free once its lease runs out.
"""

from __future__ import annotations

import time

import pytest

from elastic_runner.config import EtcdConfig, RendezvousConfig
from elastic_runner.errors import DuplicateNodeId, exit_code_for
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous import registration
from elastic_runner.rendezvous.handler import EtcdRendezvous

TTL_S = 2


# ---- item 4: one live agent per node id -------------------------------------------
@pytest.fixture
def agent(etcd):
    """Make an EtcdRendezvous (not registered yet); all are left and closed after."""
    made: list[EtcdRendezvous] = []

    def make(run: str, node_id: str) -> EtcdRendezvous:
        client = EtcdClient(EtcdConfig((etcd.endpoint,), timeout_s=5.0, retry_deadline_s=10.0))
        config = RendezvousConfig(run, node_id, max_nodes=4, lease_ttl_s=TTL_S, settle_s=0.2)
        made.append(EtcdRendezvous(client, config, p.JobSpec(1, 4, "test"), 0))
        return made[-1]

    yield make
    for each in made:
        each.shutdown.set()
        each.leave()
        each._client.close()


def holder_lease(rdzv: EtcdRendezvous) -> int | None:
    kv = rdzv._client.get(p.node_key(rdzv.prefix, rdzv.node_id))
    return kv.lease if kv else None


def test_a_live_duplicate_is_refused_and_the_id_is_free_once_its_lease_is_gone(agent):
    first = agent("dup", "a")
    first.register()
    second = agent("dup", "a")
    with pytest.raises(DuplicateNodeId) as refused:
        second.register()
    message = str(refused.value)
    assert "\n" not in message and exit_code_for(refused.value) == 2
    for part in ("node id 'a'", "run 'dup'", "addr 127.0.0.1", "pid ", "another --node-id"):
        assert part in message, message
    assert holder_lease(first) == first.lease.id  # the first agent keeps its key
    first.leave()
    third = agent("dup", "a")
    third.register()
    assert holder_lease(third) == third.lease.id


def test_a_crashed_agents_id_is_taken_over_once_its_lease_expires(agent):
    crashed = agent("crash", "a")
    crashed.register()
    crashed.lease.stop()  # no more keep-alives, no revoke: as after SIGKILL
    crashed.mirror.stop()
    successor = agent("crash", "a")
    successor.register()  # waits out the dead lease instead of failing
    assert holder_lease(successor) == successor.lease.id


def test_re_registering_after_a_lost_lease_refuses_an_id_taken_meanwhile(agent):
    first = agent("relost", "a")
    first.register()
    first._client.revoke_lease(first.lease.id)  # as if it expired during a partition
    assert first.lease.lost.wait(TTL_S * 3)
    second = agent("relost", "a")
    second.register()
    with pytest.raises(DuplicateNodeId, match="node id 'a' is already registered"):
        first.next_plan(None, "start")
    assert holder_lease(second) == second.lease.id


def test_a_create_retried_after_a_lost_answer_finds_its_own_key(agent):
    rdzv = agent("retry", "a")
    rdzv.register()
    record = registration.node_record(rdzv._config, time.time)
    registration.claim(rdzv._client, rdzv._config, rdzv.mirror, record, rdzv.lease.id)
    assert holder_lease(rdzv) == rdzv.lease.id
