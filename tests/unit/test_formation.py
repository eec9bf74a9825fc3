"""The timeout a re-formed round's group is created with (worker/formation.py).

gloo waits five timeouts for a peer's first connection; a peer that posted its
address and then died held survivors 30 s at a 6 s formation timeout, out of reach
of any call-off. The group's timeout is therefore a fifth of the formation timeout
for gloo, so the worst wait is the formation timeout itself.
"""

from __future__ import annotations

import pytest

from elastic_runner.worker import formation


@pytest.mark.parametrize("backend, formation_s, init_s", [
    ("gloo", 6.0, 1.2),                 # --lease-ttl 3: the connect gives up after 6 s
    ("gloo", 20.0, 4.0),
    ("cpu:gloo,cuda:nccl", 10.0, 2.0),  # gloo is in it: the same 5x wait
    ("gloo", 2.0, 1.0),                 # never below the floor: the store waits need a moment
    ("nccl", 6.0, 6.0),                 # no such factor: unchanged
])
def test_gloo_groups_are_formed_with_a_fifth_of_the_formation_timeout(backend, formation_s,
                                                                        init_s):
    got = formation.init_timeout_s(backend, formation_s)
    assert got == pytest.approx(init_s)
    if "gloo" in backend and formation_s / formation.GLOO_CONNECT_FACTOR >= 1.0:
        assert got * formation.GLOO_CONNECT_FACTOR == pytest.approx(formation_s)


def test_rank_0_unable_to_open_the_store_port_fails_its_re_formation_instead_of_retrying():
    """EADDRINUSE on rank 0's store says nothing about the peers: re-forming in place
    again fails the same way (900 rounds in 90 s, seen), so the worker gives up its
    re-formation and the agent's restart path frees the port."""
    from torch.distributed import DistNetworkError

    taken = DistNetworkError("The server socket has failed to listen on any local network "
                             "address. port: 29500, useIpv6: false, code: -98, name: "
                             "EADDRINUSE, message: address already in use")
    assert formation.port_taken(taken, rank=0)
    assert not formation.port_taken(taken, rank=1)  # a client does not bind
    assert not formation.port_taken(DistNetworkError("Connection reset by peer"), rank=0)


def test_each_round_has_its_own_keys_in_a_store_kept_on_one_port():
    """A fixed --master-port: the kept rank 0's multi-tenant TCPStore is the last round's
    server, keys included; the round's prefix keeps gloo from reading old addresses."""
    import datetime

    from torch.distributed import TCPStore

    from elastic_runner.etcd.server import free_port

    port = free_port()
    opened = []
    for round_number in (4, 5):
        place = formation.Place(round_number, 0, 1, "127.0.0.1", port)
        store = formation.meet(place, 5.0, lambda: False)
        opened.append(store)
        assert not store.check(["0//cpu//0/0"])  # round 5: round 4's key, before
        store.set("0//cpu//0/0", f"address of round {round_number}")
    raw = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    assert raw.get("default_pg/round-4/0//cpu//0/0") == b"address of round 4"
    assert raw.get("default_pg/round-5/0//cpu//0/0") == b"address of round 5"


def test_a_fresh_rank_0_whose_fixed_port_is_taken_says_so_in_one_line():
    """Two jobs given the same --master-port on one machine: the second's rank 0 cannot
    open its store. Before, the line blamed a lost member ("A member of the round was
    lost or its store failed") through every restart until --max-restarts."""
    import socket

    from elastic_runner.errors import GroupFormationError

    holder = socket.create_server(("", 0))
    port = holder.getsockname()[1]
    try:
        with pytest.raises(GroupFormationError) as raised:
            formation.form_first_group("gloo", 5.0, 3, 0, 2, {
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, under_elastic_run=True)
    finally:
        holder.close()
    assert str(raised.value) == (
        f"rank 0 of round 3 could not open the round's store: port {port} of its host is "
        "held by another process (another job given the same --master-port, or a process "
        "an earlier worker forked while its store listened); give each job its own "
        "--master-port, or leave it unset for a free port per round")
