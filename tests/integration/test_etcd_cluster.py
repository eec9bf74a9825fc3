"""EmbeddedEtcdCluster: three real members on loopback, as the leader-loss test and the
rendezvous bench's --etcd-members use them."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from elastic_runner._process import stat_fields
from elastic_runner.config import EtcdConfig
from elastic_runner.errors import EtcdUnavailable
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.etcd.server import EmbeddedEtcdCluster
from tests.conftest import available_etcd_binaries


def _alive(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] != b"Z"  # a zombie has exited too


@pytest.mark.parametrize("binary", available_etcd_binaries(),
                         ids=lambda binary: "etcd-" + Path(binary).parent.name)
def test_three_members_form_one_cluster_and_stop_by_pid(binary):
    with EmbeddedEtcdCluster(3, binary=binary) as cluster:
        pids = [member.process.pid for member in cluster.members]
        data_dirs = [member.data_dir for member in cluster.members]
        assert len(set(cluster.endpoints)) == 3
        clients = [EtcdClient(EtcdConfig((endpoint,), 5.0, 10.0))
                   for endpoint in cluster.endpoints]
        try:
            clients[0].put("k", b"written-at-member-0")
            # Linearizable reads at the other members see the write: one cluster, not three.
            seen = [client.get("k").value for client in clients[1:]]
            assert seen == [b"written-at-member-0"] * 2
            leaders = {client.leader_endpoint() for client in clients}
            assert len(leaders) == 1 and leaders <= set(cluster.endpoints)
        finally:
            for client in clients:
                client.close()
    assert not any(_alive(pid) for pid in pids)
    assert not any(path.exists() for path in data_dirs)


def _ranges_served(endpoint: str) -> float:
    text = urllib.request.urlopen(f"{endpoint}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("grpc_server_msg_received_total{")
               and re.search(r'grpc_method="Range"', line))


def test_clients_that_list_every_member_spread_over_them():
    """What spreads a fleet's load over the cluster (bench: --etcd-members): each
    client starts on one of the listed members, picked at random."""
    with EmbeddedEtcdCluster(3) as cluster:
        before = [_ranges_served(endpoint) for endpoint in cluster.endpoints]
        clients = [EtcdClient(EtcdConfig(cluster.endpoints, 5.0, 10.0)) for _ in range(30)]
        try:
            for client in clients:
                client.get("k")
        finally:
            for client in clients:
                client.close()
        served = [_ranges_served(endpoint) - was
                  for endpoint, was in zip(cluster.endpoints, before)]
    assert sum(served) >= 30  # one get each (a retried get would count twice)
    # All 30 on one member has a chance of 3 / 3**30.
    assert sum(1 for count in served if count) >= 2, served


def test_a_member_that_cannot_start_stops_the_others(tmp_path):
    cluster = EmbeddedEtcdCluster(3, data_parent=tmp_path)
    cluster.members[2].extra_args = ("--no-such-flag",)
    with pytest.raises(EtcdUnavailable, match="exited with code"):
        cluster.start()
    started = [member.process for member in cluster.members if member.process is not None]
    assert len(started) == 3
    assert all(process.poll() is not None for process in started)
    assert (tmp_path / "m0").exists(), "a data directory the caller gave is the caller's"


def test_a_cluster_needs_a_member():
    with pytest.raises(ValueError, match="at least one member"):
        EmbeddedEtcdCluster(0)
