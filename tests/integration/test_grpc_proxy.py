"""Agents behind etcd's gRPC proxy (`etcd grpc-proxy start`), the stateless process a
large fleet puts between its nodes and etcd. The proxy answers keep-alives on its
own schedule, and answers none on a stream whose client half-closed first; before
etcd/keepalive.py allowed for that, leases sharing a client were dropped within a
TTL through a healthy proxy."""

from __future__ import annotations

import time

import pytest

from elastic_runner.config import EtcdConfig
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.etcd.lease import KeptLease
from elastic_runner.etcd.proxy import EtcdGrpcProxy
from elastic_runner.etcd.server import EmbeddedEtcdCluster
from elastic_runner.rendezvous import protocol as p
from tests.helpers.rdzv_nodes import Node, wait_for_agreement
from tests.integration.test_rendezvous_deputies import crash


@pytest.fixture
def proxy(etcd_any_version):
    with EtcdGrpcProxy(etcd_any_version.endpoint, binary=etcd_any_version.binary) as running:
        yield etcd_any_version, running


def client_at(endpoint: str) -> EtcdClient:
    return EtcdClient(EtcdConfig((endpoint,), timeout_s=5.0, retry_deadline_s=10.0))


# One keep-alive interval through the proxy (TTL/3 at TTL 3, checked every 0.5 s) and
# one of etcd's expiry checks (every 0.5 s), with room.
SETTLED_S = 1.6


def held_by_etcd(direct: EtcdClient, leases: list[KeptLease]) -> bool:
    """Whether etcd still holds every lease, asked directly.

    Not `lease_remaining() > 0`: etcd reports the whole seconds left, rounded down, so a
    live lease last refreshed 2 s ago at TTL 3 reads 0 (a fresh clone's loaded suite
    failed on that twice); an expired one reads 0 too until etcd's expiry loop revokes
    it, then -1. So: none reads -1 now, nor again once a refresh and an expiry check
    have had time to happen."""
    if any(direct.lease_remaining(lease.id) < 0 for lease in leases):
        return False
    time.sleep(SETTLED_S)
    return all(direct.lease_remaining(lease.id) >= 0 for lease in leases)


def test_leases_sharing_a_client_stay_alive_and_a_revoked_one_is_seen(proxy):
    etcd, running = proxy
    via_proxy, direct = client_at(running.endpoint), client_at(etcd.endpoint)
    leases = [KeptLease(via_proxy, ttl_s=3) for _ in range(6)]
    try:
        time.sleep(6.0)  # two TTLs: every lease refreshed 6 times through the proxy
        assert [lease.lost.is_set() for lease in leases] == [False] * 6
        assert held_by_etcd(direct, leases)
        direct.revoke_lease(leases[0].id)  # another party drops one: etcd says so
        deadline = time.monotonic() + 6.0
        while not leases[0].lost.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert leases[0].lost.is_set()
        assert [lease.lost.is_set() for lease in leases[1:]] == [False] * 5
    finally:
        for lease in leases:
            lease.stop()
        via_proxy.close()
        direct.close()


def test_a_round_forms_loses_a_member_and_admits_a_newcomer_through_the_proxy(proxy):
    etcd, running = proxy
    nodes = [Node(running.endpoint, "proxied", f"n{i}", 8, lease_ttl_s=2, deputies=1).start()
             for i in range(3)]
    newcomer = None
    try:
        first = wait_for_agreement(nodes, 3)
        crash(nodes[2])  # no revoke: the proxy stops refreshing a TTL after its last request
        survivors = nodes[:2]
        second = wait_for_agreement(survivors, 2, timeout_s=30)
        assert second.round > first.round
        assert p.Cause.parse(second.cause).kind is p.CauseKind.MEMBER_LOST
        assert set(second.node_ids) == {"n0", "n1"}
        newcomer = Node(running.endpoint, "proxied", "n3", 8, lease_ttl_s=2, deputies=1).start()
        third = wait_for_agreement([*survivors, newcomer], 3, timeout_s=30)
        assert set(third.node_ids) == {"n0", "n1", "n3"}
        assert [n.error for n in nodes + [newcomer]] == [None] * 4
    finally:
        for each in nodes + ([newcomer] if newcomer else []):
            each.stop()


def test_leases_fail_over_to_the_second_proxy_when_the_first_dies(etcd):
    """README "Deploying": agents list two proxies, and one that dies costs a failover,
    not the leases. Keep-alives are the only calls here, so nothing else would move
    the client to the second endpoint."""
    with EtcdGrpcProxy(etcd.endpoint) as first, EtcdGrpcProxy(etcd.endpoint) as second:
        client = EtcdClient(EtcdConfig((first.endpoint, second.endpoint), timeout_s=5.0,
                                       retry_deadline_s=10.0))
        direct = client_at(etcd.endpoint)
        leases = [KeptLease(client, ttl_s=3) for _ in range(3)]
        try:
            time.sleep(1.0)
            first.process.kill()
            first.process.wait()
            time.sleep(6.0)  # two TTLs: a lease not refreshed through the second is gone
            assert [lease.lost.is_set() for lease in leases] == [False] * 3
            assert held_by_etcd(direct, leases)
        finally:
            for lease in leases:
                lease.stop()
            client.close()
            direct.close()



def test_a_proxy_listing_the_cluster_outlives_the_etcd_leader():
    """README "Deploying" starts each proxy with every member's address: the proxy, not
    the agents, fails over when a member dies. Leases kept through it live on, and a
    write through it lands, after the leader is killed."""
    with EmbeddedEtcdCluster(3) as cluster, EtcdGrpcProxy(cluster.endpoints) as running:
        via_proxy = client_at(running.endpoint)
        leases = [KeptLease(via_proxy, ttl_s=3) for _ in range(3)]
        try:
            time.sleep(1.0)
            asked = client_at(cluster.endpoints[0])  # through the proxy, a member list names it
            leader = asked.leader_endpoint()
            asked.close()
            victim = next(m for m in cluster.members if m.endpoint == leader)
            victim.kill()
            time.sleep(6.0)  # two TTLs: a lease the proxy did not carry over is gone
            assert [lease.lost.is_set() for lease in leases] == [False] * 3
            via_proxy.put("after-the-leader", b"landed")
            alive = next(m for m in cluster.members if m is not victim)
            direct = client_at(alive.endpoint)
            try:
                assert direct.get("after-the-leader").value == b"landed"
                assert held_by_etcd(direct, leases)
            finally:
                direct.close()
        finally:
            for lease in leases:
                lease.stop()
            via_proxy.close()
