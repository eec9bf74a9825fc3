"""The embedded etcd's ports: picked distinct, and moved when another process takes one
between the pick and etcd's bind (seen once in a suite: an etcd given the same port for
its clients and its peers exited with "address already in use")."""

from __future__ import annotations

import socket

import pytest

from elastic_runner.errors import EtcdUnavailable
from elastic_runner.etcd import server
from elastic_runner.etcd.server import EmbeddedEtcd, EmbeddedEtcdCluster, free_ports


def _listening_socket() -> socket.socket:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder


def test_ports_picked_together_are_distinct():
    for _ in range(20):
        ports = free_ports(6)
        assert len(set(ports)) == 6
    cluster = EmbeddedEtcdCluster(3)
    picked = [port for member in cluster.members for port in (member.client_port,
                                                              member.peer_port)]
    assert len(set(picked)) == 6
    cluster.cleanup()


def test_a_port_taken_before_etcd_binds_it_moves_a_fresh_member(monkeypatch):
    taken = _listening_socket()
    real = server.free_ports
    picks = iter([[taken.getsockname()[1], real(1)[0], real(1)[0]]])
    monkeypatch.setattr(server, "free_ports", lambda count, host="127.0.0.1": next(
        picks, None) or real(count, host))
    try:
        with EmbeddedEtcd() as etcd:
            assert etcd.client_port != taken.getsockname()[1]
            assert etcd.healthy()
            assert b"address already in use" in etcd._log_path.read_bytes()  # the first try
    finally:
        taken.close()


def test_a_port_the_caller_chose_is_never_moved():
    taken = _listening_socket()
    member = EmbeddedEtcd(client_port=taken.getsockname()[1])
    try:
        with pytest.raises(EtcdUnavailable, match="exited with code"):
            member.start()
    finally:
        member.cleanup()  # its data folder (the failed start's log): one left per suite run
        taken.close()
    assert not member.data_dir.exists()
