"""Which launch of a run id this is (protocol.origin_key), against real etcds.

Why it exists: the default run id is the script and its arguments, so the same command
started on two nodes that each run their own etcd is two jobs under one id, and their
checkpoint manifests must tell them apart (worker/checkpoint/folder_claim.py). Every
agent of one launch must see the same origin, every launch a different one, and an
agent must learn it without a request of its own at a start (the start read brings it).
"""

from __future__ import annotations

import re

import pytest

from elastic_runner.etcd.client import EtcdClient
from elastic_runner.etcd.server import EmbeddedEtcd
from elastic_runner.rendezvous import protocol as p
from tests.helpers.rdzv_nodes import Engines

SPEC = p.JobSpec(1, 4, "train.py --lr 0.1")


@pytest.fixture
def agent():
    """Make an EtcdRendezvous of run "train" on the given etcd (not registered); all
    left after."""
    engines = Engines(SPEC, lease_ttl_s=3)
    yield lambda endpoint, node_id: engines.make(endpoint, "train", node_id)
    engines.close_all()


class CountingTxn:
    """Counts the transactions a client sends (the origin must not need one)."""

    def __init__(self, client: EtcdClient):
        self.sent, self._txn = 0, client.txn
        client.txn = self._count

    def _count(self, *args, **kwargs):
        self.sent += 1
        return self._txn(*args, **kwargs)


def test_every_agent_of_a_launch_sees_one_origin_and_reads_it_for_free(etcd, agent):
    """Five agents: three deputies (a copy of every key) and two that copy the shared
    range only; the origin key lies in it."""
    agents = [agent(etcd.endpoint, node) for node in "abcde"]
    for each in agents:
        each.register()
    assert sum(not each.mirror.wide for each in agents) == 2
    first = agents[0]
    stored = first._client.get(p.origin_key(first.prefix)).value.decode()
    assert re.fullmatch(r"[0-9a-f]{16}", stored)
    counted = [CountingTxn(each._client) for each in agents]
    assert {each.origin() for each in agents} == {stored}
    assert [each.sent for each in counted] == [0] * 5  # from the copy the start read filled
    first.leave()
    third = agent(etcd.endpoint, "f")  # a later node of the same launch
    third.register()
    assert third.origin() == stored


def test_the_same_run_id_on_two_etcds_gets_two_origins(etcd, agent):
    with EmbeddedEtcd() as other_etcd:
        here, there = agent(etcd.endpoint, "a"), agent(other_etcd.endpoint, "a")
        here.register()
        there.register()
        assert here.origin() != there.origin()


def test_a_run_whose_spec_came_without_an_origin_gets_one_and_only_one(etcd, agent):
    """An older elastic-runner wrote the spec (no origin key); a newer agent that joins
    writes the origin, and every other one reads that same token."""
    first, second = agent(etcd.endpoint, "a"), agent(etcd.endpoint, "b")
    first._client.put(p.spec_key(first.prefix), SPEC.to_json())
    first.register()
    second.register()
    assert first._client.get(p.origin_key(first.prefix)) is None
    origins = {first.origin(), second.origin(), first.origin()}
    assert len(origins) == 1
    assert first._client.get(p.origin_key(first.prefix)).value.decode() in origins


def test_a_standby_node_asks_for_the_origin_before_its_copy_starts(etcd, agent):
    """A node joining a run that re-forms in place starts its workers before it is
    announced (agent/standby.py): its copy is empty then, so it asks etcd."""
    first = agent(etcd.endpoint, "a")
    first.register()
    first._client.put(p.inplace_key(first.prefix), b"0")
    standby = agent(etcd.endpoint, "b")
    assert standby.register(unless_in_place=True) is False
    assert standby.origin() == first.origin()


def test_an_origin_key_that_holds_no_token_is_not_passed_on(etcd, agent, caplog):
    """Someone wrote a path and a newline into the key: nothing of it reaches the
    workers' environment or a manifest; the run id alone names the run, as before."""
    first = agent(etcd.endpoint, "a")
    first.register()
    first._client.put(p.origin_key(first.prefix), b"../x\nrm -rf /")
    late = agent(etcd.endpoint, "b")
    late.register()
    assert late.origin() == ""
    assert "not a token elastic-runner wrote" in caplog.text
