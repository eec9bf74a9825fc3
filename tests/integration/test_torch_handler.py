"""The etcd-v3 torchrun handler and its store against a real etcd, in one process."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from torch.distributed import DistStoreError
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError, RendezvousParameters, RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elastic_runner.config import EtcdConfig
from elastic_runner.errors import RendezvousTimeout, RunFinished
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.rendezvous.torchrun_plugin import (
    EtcdV3RendezvousHandler, create_handler, rendezvous_config,
)
from elastic_runner.rendezvous.torch_store import EtcdStore

WAIT_S = 30


def params(endpoint: str, node_id: str, min_nodes: int = 1, max_nodes: int = 2,
           **conf) -> RendezvousParameters:
    conf = {"node_id": node_id, "lease_ttl": "2", "settle": "0.5", "timeout": "30",
            "store_timeout": "10", **conf}
    return RendezvousParameters("etcd-v3", endpoint, "torch-it", min_nodes, max_nodes,
                                local_addr="127.0.0.1", **conf)


def wait_until(predicate, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class WatchedClient:
    """The store's EtcdClient, telling a test what it would otherwise sleep for:
    `watching` is set once a blocked read watches for its missing keys, and `found`
    lists the keys each range read returned."""

    def __init__(self, client: EtcdClient):
        self._client = client
        self.watching = threading.Event()
        self.found: list[set[str]] = []

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def get_prefix(self, prefix: str):
        entries, revision = self._client.get_prefix(prefix)
        self.found.append({kv.key.rsplit("/", 1)[-1] for kv in entries})
        return entries, revision

    def watch_prefix(self, *args, **kwargs):
        watch = self._client.watch_prefix(*args, **kwargs)
        self.watching.set()
        return watch


@pytest.fixture
def client(etcd):
    watched = WatchedClient(EtcdClient(EtcdConfig((etcd.endpoint,), timeout_s=2.0)))
    yield watched
    watched.close()


@pytest.fixture
def store(client):
    return EtcdStore(client, "/torch-store-test/", timedelta(seconds=5))


def test_entry_point_registers_the_backend_with_torch(etcd):
    assert "etcd-v3" in rendezvous_handler_registry._registry
    handler = get_rendezvous_handler(params(etcd.endpoint, "solo"))
    try:
        assert isinstance(handler, EtcdV3RendezvousHandler)
        assert handler.get_backend() == "etcd-v3"
        assert handler.get_run_id() == "torch-it"
        assert not handler.is_closed()
    finally:
        assert handler.shutdown()


def test_two_handlers_rendezvous_share_a_store_then_shrink(etcd):
    a = create_handler(params(etcd.endpoint, "a"))
    b = create_handler(params(etcd.endpoint, "b"))
    try:
        with ThreadPoolExecutor(2) as pool:
            info_a, info_b = (f.result(WAIT_S) for f in
                              [pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)])
        assert {info_a.rank, info_b.rank} == {0, 1}
        assert info_a.world_size == info_b.world_size == 2
        boot_a, boot_b = info_a.bootstrap_store_info, info_b.bootstrap_store_info
        assert (boot_a.master_addr, boot_a.master_port) == (boot_b.master_addr,
                                                           boot_b.master_port)
        assert boot_a.master_addr == "127.0.0.1" and boot_a.master_port > 0
        assert a.num_nodes_waiting() == b.num_nodes_waiting() == 0

        exercise_shared_store(info_a.store, info_b.store)

        assert b.shutdown()  # revokes b's lease: a notices without waiting for the TTL
        wait_until(lambda: a.num_nodes_waiting() > 0, "a to see b leave")
        again = a.next_rendezvous()
        assert (again.rank, again.world_size) == (0, 1)
        assert a.plan.round > 0 and "member-lost" in a.plan.cause
    finally:
        a.shutdown()
        b.shutdown()


def exercise_shared_store(store_a: EtcdStore, store_b: EtcdStore) -> None:
    """Two agents' stores of one round: writes of one are reads of the other."""
    store_a.set("k", "v")
    assert store_b.get("k") == b"v"
    store_b.wait(["k"])

    with ThreadPoolExecutor(1) as pool:  # the waiting itself: test_a_get_waits_...
        blocked = pool.submit(store_a.get, "late")
        store_b.set("late", b"\x00\xff")
        assert blocked.result(5) == b"\x00\xff"

    def increment(store: EtcdStore) -> list[int]:
        return [store.add("counter", 1) for _ in range(50)]

    with ThreadPoolExecutor(2) as pool:
        seen = [v for f in [pool.submit(increment, store_a), pool.submit(increment, store_b)]
                for v in f.result(WAIT_S)]
    assert sorted(seen) == list(range(1, 101))  # no lost update, no duplicate value
    assert store_a.get("counter") == b"100"


def test_store_operations(store):
    store.multi_set(["x", "y"], ["1", b"2"])
    assert store.multi_get(["y", "x"]) == [b"2", b"1"]
    assert store.check(["x", "y"]) and not store.check(["x", "nope"])
    assert store.add("n", 5) == 5 and store.add("n", -2) == 3
    assert store.compare_set("cas", "", "first") == b"first"  # empty: only if absent
    assert store.compare_set("cas", "wrong", "second") == b"first"
    assert store.compare_set("cas", "first", "second") == b"second"
    assert store.compare_set("absent", "something", "x") == b"something"
    assert sorted(store.list_keys()) == ["cas", "n", "x", "y"]
    assert store.num_keys() == 4
    assert store.delete_key("x") and not store.delete_key("x")
    assert store.num_keys() == 3


def test_store_waits_time_out_with_torch_errors(store):
    started = time.monotonic()
    with pytest.raises(DistStoreError, match="missing"):
        store.wait(["missing"], timedelta(milliseconds=300))
    assert time.monotonic() - started > 0.25  # it waited for the key, then gave up
    store.set_timeout(timedelta(milliseconds=200))
    with pytest.raises(DistStoreError):
        store.get("missing")
    store.set("present", "here")
    store.wait(["present"], timedelta(milliseconds=1))  # present: no wait needed


class RacingClient(WatchedClient):
    """Another writer bumps the counter between our read and our write, `races` times
    (None: forever): the add's compare-and-swap loses exactly then."""

    def __init__(self, client: EtcdClient, races: int | None):
        super().__init__(client)
        self.races, self.lost = races, 0

    def txn(self, compares, puts, *args, **kwargs):
        if self.races is None or self.lost < self.races:
            self.lost += 1
            key = puts[0].key
            kv = self._client.get(key)
            self._client.put(key, str((int(kv.value) if kv else 0) + 100).encode())
        return self._client.txn(compares, puts, *args, **kwargs)


def test_add_retries_lost_races_and_counts_every_winner(etcd, client):
    racing = RacingClient(client._client, races=3)
    store = EtcdStore(racing, "/torch-store-add/", timedelta(seconds=5))
    assert store.add("n", 1) == 301  # three rival adds of 100 won first, then ours
    assert racing.lost == 3
    assert store.add("n", 1) == 302


def test_add_that_always_loses_ends_in_a_torch_store_error(etcd, client):
    store = EtcdStore(RacingClient(client._client, races=None), "/torch-store-lose/",
                      timedelta(milliseconds=300))
    with pytest.raises(DistStoreError, match="kept losing races"):
        store.add("n", 1)


def test_a_get_waits_for_a_missing_key_and_returns_its_value(store, client):
    with ThreadPoolExecutor(1) as pool:
        blocked = pool.submit(store.get, "late")
        assert client.watching.wait(WAIT_S), "the get never watched for its key"
        assert not blocked.done()  # it read, found nothing, and waits
        store.set("late", b"\x00\xff")
        assert blocked.result(5) == b"\x00\xff"


def test_wait_for_several_keys_returns_when_the_last_arrives(store, client):
    """Seeing p alone must not end a wait for p and q (it would raise DistStoreError)."""
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(store.wait, ["p", "q"])
        assert client.watching.wait(WAIT_S), "the wait never watched for its keys"
        store.set("p", "1")
        wait_until(lambda: {"p"} in client.found, "the waiter to read p")
        assert not waiting.done()
        store.set("q", "2")
        assert waiting.result(5) is None


def test_set_closed_finishes_the_run_for_late_agents(etcd):
    first = create_handler(params(etcd.endpoint, "first", max_nodes=1))
    late = create_handler(params(etcd.endpoint, "late", max_nodes=1))
    try:
        assert first.next_rendezvous().world_size == 1
        first.set_closed()
        wait_until(late.is_closed, "the finished round to be visible")
        with pytest.raises(RendezvousClosedError) as caught:
            late.next_rendezvous()
        assert isinstance(caught.value.__cause__, RunFinished)
    finally:
        first.shutdown()
        late.shutdown()


def test_too_few_nodes_is_torchs_timeout_error(etcd):
    handler = create_handler(params(etcd.endpoint, "lonely", min_nodes=2, join_timeout="1"))
    try:
        with pytest.raises(RendezvousTimeoutError) as caught:
            handler.next_rendezvous()
        assert isinstance(caught.value.__cause__, RendezvousTimeout)
    finally:
        handler.shutdown()


def test_config_from_torchrun_strings():
    config = rendezvous_config(RendezvousParameters(
        "etcd-v3", "h:1", "job", 1, 3, timeout="900", lease_ttl="3", settle="1.5",
        node_id="n1", local_addr="10.0.0.5", master_port="29500"))
    assert (config.join_timeout_s, config.lease_ttl_s, config.settle_s) == (900, 3, 1.5)
    assert (config.node_id, config.node_addr, config.master_port) == ("n1", "10.0.0.5", 29500)
    assert rendezvous_config(RendezvousParameters(
        "etcd-v3", "h:1", "job", 1, 3, timeout="900", join_timeout="20")).join_timeout_s == 20


@pytest.mark.parametrize("endpoint", ["", "ftp://h:1", "h:notaport"])
def test_bad_endpoint_is_value_error(endpoint):
    with pytest.raises(ValueError):
        create_handler(RendezvousParameters("etcd-v3", endpoint, "job", 1, 1))


@pytest.mark.parametrize("run_id, node_id, phrase", [
    ("victim/rounds/0/join", "n1", "--rdzv-id 'victim/rounds/0/join' is not a valid id"),
    ("job", "a/b", "--rdzv-conf node_id 'a/b' is not a valid id"),
    ("job", "..", "--rdzv-conf node_id '..' is not a valid id"),
    ("job\nx", "n1", "--rdzv-id 'job\\nx' is not a valid id"),
])
def test_ids_follow_the_cli_grammar(run_id, node_id, phrase):
    """torchrun users get the same id rules, as the ValueError torch reports."""
    with pytest.raises(ValueError) as caught:
        rendezvous_config(RendezvousParameters("etcd-v3", "h:1", run_id, 1, 1, node_id=node_id))
    assert phrase in str(caught.value)


def test_default_node_id_is_a_valid_id():
    from elastic_runner.ids import id_problem

    config = rendezvous_config(RendezvousParameters("etcd-v3", "h:1", "job", 1, 1))
    assert id_problem(config.node_id) is None
