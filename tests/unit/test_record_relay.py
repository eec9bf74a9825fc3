"""The agent answers its workers for the checkpoint record (record_relay.py): one read
per burst of askers, never an answer older than the question, errors passed on typed."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from elastic_runner.errors import EtcdError, EtcdUnavailable
from elastic_runner.record_relay import (
    RECORD_SOCKET, CoalescedRead, RecordRelay, ask_record, read_json,
)
from elastic_runner.worker.checkpoint.etcd_store import RelayedLatestStore


class GatedReads:
    """A reader whose reads wait for the test; each returns the version current when
    it began, so an answer can be dated."""

    def __init__(self) -> None:
        self.version = 0
        self.begun = 0
        self.release = threading.Semaphore(0)
        self.started = threading.Semaphore(0)

    def __call__(self) -> dict:
        self.begun += 1
        seen = self.version
        self.started.release()
        assert self.release.acquire(timeout=30)
        return {"step": seen}


def ask_in_threads(read, count: int) -> tuple[list, list[threading.Thread]]:
    answers: list = []
    threads = [threading.Thread(target=lambda: answers.append(read())) for _ in range(count)]
    for thread in threads:
        thread.start()
    return answers, threads


def wait_for_waiters(coalesced: CoalescedRead, count: int) -> None:
    """Until `count` askers wait on the read in flight (CPython's Condition keeps its
    waiters in `_waiters`): otherwise a slow thread could arrive after it."""
    deadline = time.monotonic() + 30
    while len(coalesced._changed._waiters) < count:
        assert time.monotonic() < deadline, "the askers never queued"
        time.sleep(0.001)


def test_askers_during_a_read_share_the_next_one_and_none_gets_an_older_answer():
    reads = GatedReads()
    coalesced = CoalescedRead(reads)
    first, first_threads = ask_in_threads(coalesced, 1)
    assert reads.started.acquire(timeout=30)          # read 1 began, at version 0
    reads.version = 1                                 # rank 0 publishes meanwhile
    later, later_threads = ask_in_threads(coalesced, 7)
    wait_for_waiters(coalesced, 7)                    # all seven asked during read 1
    reads.release.release()                           # read 1 ends: its asker only
    for thread in first_threads:
        thread.join(30)
    assert first == [{"step": 0}]
    assert reads.started.acquire(timeout=30)          # read 2 serves the other seven
    reads.release.release()
    for thread in later_threads:
        thread.join(30)
    assert later == [{"step": 1}] * 7
    assert reads.begun == 2


def test_a_read_waits_for_the_nodes_other_workers_then_serves_them_all_at_once():
    reads = GatedReads()
    coalesced = CoalescedRead(reads, expected=3, window_s=60.0)
    answers, threads = ask_in_threads(coalesced, 2)
    wait_for_waiters(coalesced, 2)                    # the first gathers, the second waits
    assert reads.begun == 0                           # nobody read with one worker missing
    more, late = ask_in_threads(coalesced, 1)
    assert reads.started.acquire(timeout=30)          # the third asked: the read begins
    reads.release.release()
    for thread in threads + late:
        thread.join(30)
    assert answers + more == [{"step": 0}] * 3 and reads.begun == 1


def test_a_worker_alone_waits_out_the_window_and_is_answered():
    calls = []
    coalesced = CoalescedRead(lambda: calls.append(1) or {"step": 4}, expected=8,
                              window_s=0.01)
    assert coalesced() == {"step": 4} and len(calls) == 1


def test_a_lone_asker_reads_and_the_next_asker_reads_again():
    calls = []
    coalesced = CoalescedRead(lambda: calls.append(1) or {"step": len(calls)})
    assert coalesced() == {"step": 1}
    assert coalesced() == {"step": 2}


def test_a_failed_read_fails_its_askers_and_the_next_read_is_tried_afresh():
    outcomes = iter([EtcdUnavailable("etcd at x did not answer"), {"step": 3}])

    def read():
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    coalesced = CoalescedRead(read)
    with pytest.raises(EtcdUnavailable, match="did not answer"):
        coalesced()
    assert coalesced() == {"step": 3}


@pytest.fixture
def relay_of(tmp_path):
    started = []

    def start(read) -> RecordRelay:
        relay = RecordRelay.start(tmp_path, read)
        started.append(relay)
        return relay

    yield start
    for relay in started:
        relay.close()


def test_a_worker_gets_the_record_the_agent_reads(relay_of, tmp_path):
    relay = relay_of(lambda: {"url": "file:///c/step-1", "step": 1, "sha256": "ab" * 32})
    assert relay.path == tmp_path / RECORD_SOCKET
    assert ask_record(str(relay.path))["step"] == 1


def test_no_record_is_none(relay_of):
    assert ask_record(str(relay_of(lambda: None).path)) is None


@pytest.mark.parametrize("error", [EtcdUnavailable("etcd at http://x:1 did not answer"),
                                   EtcdError("etcd at http://x:1 is full and refused get")])
def test_the_agents_etcd_error_reaches_the_worker_with_its_type_and_line(relay_of, error):
    def read():
        raise error
    with pytest.raises(type(error)) as raised:
        ask_record(str(relay_of(read).path))
    assert str(raised.value) == str(error)


def test_a_record_etcd_holds_as_garbage_is_a_clear_error_not_a_hang(relay_of):
    class Kv:
        value = b"{not json"

    class Client:
        def get(self, key):
            return Kv()

    with pytest.raises(EtcdError, match="could not read the checkpoint record"):
        ask_record(str(relay_of(read_json(Client(), "/k")).path))


def test_an_unknown_request_is_answered_with_an_error(relay_of):
    relay = relay_of(lambda: {"step": 1})
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(str(relay.path))
        sock.sendall(b"../../etc\n")
        answer = sock.recv(4096)
    assert b"unknown request" in answer and b"step" not in answer


def test_a_worker_that_connects_and_never_asks_does_not_hold_up_the_agents_exit(tmp_path):
    relay = RecordRelay.start(tmp_path, lambda: None)
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(str(relay.path))
    closing = threading.Thread(target=relay.close)
    closing.start()
    closing.join(30)
    silent.close()
    assert not closing.is_alive()
    assert not (tmp_path / RECORD_SOCKET).exists()


def test_no_listener_is_an_oserror_the_worker_can_fall_back_on(tmp_path):
    with pytest.raises(OSError):
        ask_record(str(tmp_path / RECORD_SOCKET))


def test_a_folder_too_deep_for_a_unix_socket_leaves_the_workers_on_etcd(tmp_path):
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    assert RecordRelay.start(deep, lambda: None) is None


class OwnStore:
    def __init__(self, opened: list) -> None:
        opened.append(self)
        self.published: list = []
        self.closed = False

    def read(self):
        return {"step": "from etcd"}

    def publish(self, record):
        self.published.append(record)
        return True

    def retract(self, bad, replacement):
        return True

    def close(self):
        self.closed = True


def test_the_relayed_store_reads_through_the_agent_and_opens_etcd_only_to_write(relay_of):
    opened: list = []
    relay = relay_of(lambda: {"step": 7})
    store = RelayedLatestStore(str(relay.path), lambda: OwnStore(opened))
    assert store.read() == {"step": 7}
    assert opened == []                               # a reader never opens etcd
    assert store.publish({"step": 8}) and store.retract({"step": 8}, {"step": 7})
    assert len(opened) == 1 and opened[0].published == [{"step": 8}]
    store.close()
    assert opened[0].closed


def test_the_relayed_store_reads_etcd_itself_where_no_agent_listens(tmp_path: Path):
    opened: list = []
    store = RelayedLatestStore(str(tmp_path / RECORD_SOCKET), lambda: OwnStore(opened))
    assert store.read() == {"step": "from etcd"}
    assert len(opened) == 1
