"""The client facade against every etcd version we support (3.5 wheel; 3.4 Debian)."""

from __future__ import annotations

import threading
import time

import pytest

from elastic_runner.config import EtcdConfig
from elastic_runner.errors import EtcdError, EtcdUnavailable, LeaseNotFound
from elastic_runner.etcd.client import (
    Delete, EtcdClient, Get, KeyValue, Nested, Put, key_missing, mod_revision_is, prefix_empty,
)
from elastic_runner.etcd.lease import KeptLease
from elastic_runner.etcd.mirror import PrefixMirror
from elastic_runner.etcd.values import MAX_TXN_OPS


def make_client(endpoint: str, deadline: float = 5.0) -> EtcdClient:
    return EtcdClient(EtcdConfig((endpoint,), timeout_s=2.0, retry_deadline_s=deadline))


def test_put_get_txn_and_prefix(etcd_any_version):
    client = make_client(etcd_any_version.endpoint)
    revision = client.put("/t/a", b"1")
    assert client.get("/t/a").value == b"1"
    assert client.get("/t/missing") is None
    assert client.create_if_absent("/t/b", b"2") is True
    assert client.create_if_absent("/t/b", b"3") is False
    result = client.txn([mod_revision_is("/t/a", revision)], [Put("/t/a", b"won")])
    assert result.succeeded and client.get("/t/a").value == b"won"
    assert not client.txn([mod_revision_is("/t/a", revision)], [Put("/t/a", b"lost")]).succeeded
    entries, _ = client.get_prefix("/t/")
    assert [(kv.key, kv.value) for kv in entries] == [("/t/a", b"won"), ("/t/b", b"2")]
    assert client.server_version().startswith("3.")
    client.close()


def test_a_txn_compares_a_whole_prefix_and_reads_in_its_branch(etcd_any_version):
    """What registration.check_spec sends: create where a prefix is empty, else read."""
    client = make_client(etcd_any_version.endpoint)
    branches = ([Put("/s/spec", b"mine")],
                [Get("/s/spec"), Get("/old/", prefix=True, count_only=True)])
    first = client.txn([key_missing("/s/spec"), prefix_empty("/old/")], *branches)
    assert first.succeeded and first.reads == () and client.get("/s/spec").value == b"mine"
    again = client.txn([key_missing("/s/spec"), prefix_empty("/old/")], *branches)
    assert not again.succeeded and again.reads[0].kvs[0].value == b"mine"
    assert again.reads[1].count == 0 and again.reads[1].kvs == ()
    client.txn([], [Delete("/s/spec")])
    client.put("/old/x", b"1")
    client.put("/old/y", b"2")
    client.put("/older", b"not under /old/")
    blocked = client.txn([key_missing("/s/spec"), prefix_empty("/old/")], *branches)
    assert not blocked.succeeded and client.get("/s/spec") is None
    assert blocked.reads[0].kvs == () and blocked.reads[1].count == 2
    assert client.txn([prefix_empty("/ol/")], [Put("/s/spec", b"x")]).succeeded
    client.close()


def first_free_slot(owner: bytes) -> tuple[Nested, ...]:
    """What registration nests: slot 0 if free, else slot 1, else slot 2."""
    chain: tuple[Nested, ...] = ()
    for slot in (2, 1, 0):
        chain = (Nested((key_missing(f"/n/slot/{slot}"),), (Put(f"/n/slot/{slot}", owner),),
                        chain),)
    return chain


def test_nested_txns_commit_with_the_outer_one_and_a_last_read_sees_them(etcd_any_version):
    """What registration sends: its node key, round 0 where absent, the first free slot,
    then a read of the shared range that must show all three at the result's revision."""
    client = make_client(etcd_any_version.endpoint)
    first_round = Nested((key_missing("/n/round"),), (Put("/n/round", b"open 0"),))

    def register(node: str):
        return client.txn([key_missing(f"/n/nodes/{node}")],
                          [Put(f"/n/nodes/{node}", b"x"), first_round,
                           *first_free_slot(node.encode()), Get("/n/r", end="/n/t")])
    results = [register(node) for node in ("a", "b", "c", "d")]
    assert all(r.succeeded for r in results)
    assert [kv.key for kv in results[0].reads[0].kvs] == ["/n/round", "/n/slot/0"]
    last = {kv.key: kv.value for kv in results[3].reads[0].kvs}
    assert last == {"/n/round": b"open 0", "/n/slot/0": b"a", "/n/slot/1": b"b",
                    "/n/slot/2": b"c"}  # d found every slot taken and took none
    assert max(kv.mod_revision for kv in results[2].reads[0].kvs) == results[2].revision
    assert client.get("/n/round").version == 1  # created once, by the first
    refused = register("a")  # the outer compare fails: nothing nested runs
    assert not refused.succeeded and refused.reads == () and client.get("/n/round").version == 1
    client.close()


def test_lease_revoke_deletes_keys_and_expiry_is_reported(etcd_any_version):
    client = make_client(etcd_any_version.endpoint)
    lost = threading.Event()
    lease = KeptLease(client, ttl_s=1, on_lost=lost.set)
    client.put("/l/kept", b"x", lease=lease.id)
    assert lost.wait(2.5) is False  # kept alive past its TTL
    assert client.get("/l/kept") is not None
    lease.revoke()
    assert client.get("/l/kept") is None
    orphan = client.grant_lease(1)
    assert client.refresh_lease(orphan, deadline_s=2.0) > 0
    client.revoke_lease(orphan)
    assert client.refresh_lease(orphan, deadline_s=2.0) <= 0
    client.close()


def test_a_gone_lease_is_a_typed_error_and_revoking_it_again_is_quiet(etcd_any_version):
    """Registration retries on LeaseNotFound (registration.take_lease): by type, not text."""
    client = make_client(etcd_any_version.endpoint)
    gone = client.grant_lease(5)
    client.revoke_lease(gone)
    client.revoke_lease(gone)  # already gone: nothing to do, no error
    for write in (lambda: client.put("/g/k", b"x", lease=gone),
                  lambda: client.create_if_absent("/g/k", b"x", lease=gone)):
        with pytest.raises(LeaseNotFound) as caught:
            write()
        assert isinstance(caught.value, EtcdError) and "lease" in str(caught.value)
    assert client.get("/g/k") is None
    client.close()


def test_mirror_follows_the_prefix_across_a_server_restart(etcd_any_version):
    client = make_client(etcd_any_version.endpoint, deadline=15.0)
    client.put("/m/before", b"1")
    mirror = PrefixMirror(client, "/m/")
    mirror.start()
    assert mirror.get("/m/before").value == b"1"
    etcd_any_version.stop()
    etcd_any_version.start()
    client.put("/m/after", b"2")
    client.txn([key_missing("/m/gone")], [Put("/m/gone", b"x")])
    assert mirror.wait_until(lambda: mirror.get("/m/gone") is not None, timeout_s=15)
    assert sorted(kv.key for kv in mirror.children("/m/")) == ["/m/after", "/m/before", "/m/gone"]
    mirror.stop()
    client.close()


def test_a_mirror_resumed_past_etcds_compaction_reads_again_and_follows_on(etcd_any_version):
    """The watch's stream breaks after a quiet longer than etcd keeps its history
    (auto-compaction): its resume revision is gone. Before, the watch retried that
    revision forever and the copy never changed again."""
    client = make_client(etcd_any_version.endpoint, deadline=15.0)
    client.put("/m/before", b"1")
    mirror = PrefixMirror(client, "/m/")
    mirror.start()
    for i in range(20):  # others' writes move the revision on while /m/ is quiet
        revision = client.put(f"/other/{i}", b"x")
    client.compact(revision)
    etcd_any_version.stop()
    etcd_any_version.start()
    client.put("/m/after", b"2")
    assert mirror.wait_until(lambda: mirror.get("/m/after") is not None, timeout_s=15)
    client.put("/m/later", b"3")
    assert mirror.wait_until(lambda: mirror.get("/m/later") is not None, timeout_s=15)
    assert sorted(kv.key for kv in mirror.children("/m/")) == ["/m/after", "/m/before", "/m/later"]
    mirror.stop()
    client.close()


def test_a_copy_whose_missed_events_were_compacted_is_read_again(etcd):
    """What a re-read must bring back: a key written and one deleted while the watch
    was down, both compacted away (a copy started from an old snapshot stands in for
    a watch that was down: the same events are missing)."""
    client = make_client(etcd.endpoint)
    stale_revision = client.put("/n/gone", b"1")
    client.put("/n/new", b"2")
    client.txn([], [Delete("/n/gone")])
    revision = client.put("/other", b"x")
    client.compact(revision)
    compactions = []
    watch = client.watch_prefix("/n/", stale_revision + 1, lambda events: None,
                                on_compacted=compactions.append)
    mirror = PrefixMirror(client, "/n/", narrow=("/n/", "/n0"))
    mirror.start(snapshot=([KeyValue("/n/gone", b"1", stale_revision, stale_revision, 1, 0)],
                           stale_revision))
    assert mirror.wait_until(lambda: mirror.get("/n/new") is not None, timeout_s=15)
    assert [kv.key for kv in mirror.children("/n/")] == ["/n/new"]
    deadline = time.monotonic() + 10
    while not compactions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert compactions == [revision]
    client.put("/n/after", b"3")
    assert mirror.wait_until(lambda: mirror.get("/n/after") is not None, timeout_s=15)
    watch.cancel()
    mirror.stop()
    client.close()


def test_etcd_refuses_a_transaction_of_more_than_max_txn_ops_operations(etcd_any_version):
    """The limit our chunked reads and writes keep to (MAX_TXN_OPS), on 3.4 and 3.5."""
    client = make_client(etcd_any_version.endpoint)
    assert len(client.txn([], [Get(f"/t/{i}") for i in range(MAX_TXN_OPS)]).reads) == MAX_TXN_OPS
    with pytest.raises(EtcdError, match="too many operations"):
        client.txn([], [Get(f"/t/{i}") for i in range(MAX_TXN_OPS + 1)])
    client.close()


def test_a_range_read_of_more_than_grpcs_default_4_mib_is_answered(etcd):
    """What a deputy's whole-run read holds after ~600 rounds at 1,024 nodes (each
    round's plan about 8 KB): gRPC's default limit refused it ('Received message
    larger than max')."""
    client = make_client(etcd.endpoint)
    for number in range(600):
        client.put(f"/run/rounds/{number:06d}/plan", b"x" * 8300)
    kvs, _ = client.get_prefix("/run/")
    assert len(kvs) == 600 and sum(len(kv.value) for kv in kvs) > 4 * 2**20
    client.close()


def test_mirror_indexes_directories_and_counts_departures(etcd):
    client = make_client(etcd.endpoint)
    for name in ("a", "b", "c"):
        client.put(f"/d/nodes/{name}", b"1")
    client.put("/d/rounds/0/join/a", b"j")
    client.put("/d/round", b"r")
    mirror = PrefixMirror(client, "/d/")
    mirror.start()
    assert [kv.key for kv in mirror.children("/d/nodes/")] == \
        ["/d/nodes/a", "/d/nodes/b", "/d/nodes/c"]
    assert mirror.children("/d/") == [mirror.get("/d/round")]  # direct children only
    assert mirror.census("/d/nodes/") == (3, 0)
    deleted = client.txn([], [Delete("/d/nodes/b")]).revision
    added = client.put("/d/nodes/d", b"1")
    assert mirror.wait_revision(max(deleted, added), timeout_s=5)
    assert mirror.census("/d/nodes/") == (3, 1)  # same count, but someone left
    assert [kv.key for kv in mirror.children("/d/nodes/")] == \
        ["/d/nodes/a", "/d/nodes/c", "/d/nodes/d"]
    assert mirror.census("/d/rounds/0/join/") == (1, 0)
    assert mirror.census("/d/missing/") == (0, 0)
    mirror.stop()
    client.close()


def test_unreachable_endpoint_is_a_typed_error_naming_it():
    from elastic_runner.etcd.server import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"
    client = make_client(endpoint, deadline=1.0)
    with pytest.raises(EtcdUnavailable, match=endpoint):
        client.get("/x")
    client.close()


def test_mirror_records_when_it_first_saw_each_key_on_its_own_clock(etcd):
    """Registration times for decisions: one agent's clock, never another machine's."""
    client = make_client(etcd.endpoint)
    now = [100.0]
    client.put("/f/old", b"1")
    mirror = PrefixMirror(client, "/f/", clock=lambda: now[0])
    mirror.start()
    assert mirror.first_seen("/f/old") == 100.0  # found at start: counts as seen then
    now[0] = 105.0
    assert mirror.wait_revision(client.put("/f/new", b"1"), timeout_s=5)
    assert mirror.first_seen("/f/new") == 105.0
    now[0] = 107.0
    assert mirror.wait_revision(client.put("/f/old", b"2"), timeout_s=5)
    assert mirror.first_seen("/f/old") == 100.0  # rewritten, not new
    client.txn([], [Delete("/f/new")])
    now[0] = 109.0
    assert mirror.wait_revision(client.put("/f/new", b"again"), timeout_s=5)
    assert mirror.first_seen("/f/new") == 109.0  # deleted and created again: new
    now[0] = 111.0
    mirror.resync()
    assert (mirror.first_seen("/f/old"), mirror.first_seen("/f/new")) == (100.0, 109.0)
    assert mirror.first_seen("/f/missing") is None
    assert mirror.first_seen_in("/f/") == {"/f/old": 100.0, "/f/new": 109.0}
    mirror.stop()
    client.close()


def test_keep_alives_share_one_stream_that_survives_a_server_restart_and_a_freeze(
        etcd_any_version, monkeypatch):
    """Refreshes go over one long-lived LeaseKeepAlive stream (etcd/keepalive.py: a new
    stream per refresh cost etcd 4-8x the CPU). A stream broken by a restart costs at
    most that refresh's one-shot, and a new stream opens; one silent while the server
    is frozen is kept (its answer may only be late) and serves again after."""
    from elastic_runner.etcd import client as client_module
    from elastic_runner.etcd import keepalive

    opened = []
    real_open = client_module._open_keepalive_stream
    monkeypatch.setattr(client_module, "_open_keepalive_stream",
                        lambda owner, requests: opened.append(owner) or real_open(owner, requests))
    client = make_client(etcd_any_version.endpoint, deadline=15.0)
    one_shot = []
    real_one_shot = client._keepalive.one_shot
    client._keepalive.one_shot = lambda *args: one_shot.append(args) or real_one_shot(*args)

    def long_lived() -> int:
        return len(opened) - len(one_shot)  # each one-shot opens a stream of its own
    lease = client.grant_lease(30)
    assert [client.refresh_lease(lease, deadline_s=2.0) for _ in range(20)] == [30] * 20
    assert long_lived() == 1 and one_shot == []

    etcd_any_version.stop()
    etcd_any_version.start()
    assert client.refresh_lease(lease, deadline_s=10.0) > 0  # the old stream died with etcd
    assert client.refresh_lease(lease, deadline_s=10.0) > 0
    assert long_lived() == 2 and len(one_shot) <= 1
    # Settle the stream: an ask after the restart may have given up (to its one-shot)
    # and its late answer be kept, which the frozen ask below would then rightly use
    # instead of a one-shot (a fresh clone met that). Once every ask has its answer,
    # one more refresh takes whatever was kept.
    stream, settled_by = client._keepalive._stream, time.monotonic() + 10.0
    while stream._answered.get(lease, 0) < stream._asked.get(lease, 0):
        assert time.monotonic() < settled_by, "the stream never answered every ask"
        time.sleep(0.05)
    assert client.refresh_lease(lease, deadline_s=10.0) > 0

    before, missed, asks = len(one_shot), [], []
    real_missed, real_ask = keepalive._Stream._missed, keepalive._Stream.ask
    monkeypatch.setattr(keepalive._Stream, "_missed", lambda stream, *args: missed.append(
        real_missed(stream, *args)) or missed[-1])

    def ask(stream, *args):
        """What each ask on a stream ended with, for the assertion's message."""
        started = time.monotonic()
        try:
            asks.append(("answer", real_ask(stream, *args)))
        except BaseException as error:
            asks.append(("raised", repr(error)))
            raise
        finally:
            asks[-1] += (round(time.monotonic() - started, 2), stream is client._keepalive._stream)
        return asks[-1][1]
    monkeypatch.setattr(keepalive._Stream, "ask", ask)
    etcd_any_version.pause()
    threading.Timer(10.0, etcd_any_version.resume).start()
    # The stream has half of the 14 s and hears nothing: its ask runs out (a miss). Then
    # either the one-shot refresh waits out the rest of the 10 s freeze and gets the
    # answer, or, where the asking thread ran again only after the server was back (2
    # loaded cores: seen in three full suite runs, with 2, 4 and 7 s halves), the
    # stream's answer that came meanwhile is taken instead (_Stream._missed). Exactly one.
    assert client.refresh_lease(lease, deadline_s=14.0) > 0
    assert missed, f"the stream's ask did not run out while etcd was frozen: {asks}"
    one_shots = before + (missed[0] is None)
    assert len(one_shot) == one_shots
    assert client.refresh_lease(lease, deadline_s=2.0) > 0
    assert long_lived() == 2 and len(one_shot) == one_shots

    client.revoke_lease(lease)
    assert client.refresh_lease(lease, deadline_s=2.0) <= 0  # gone: said on the stream too
    client.close()
