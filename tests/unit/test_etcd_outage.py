"""The agent's wait for etcd: a silent etcd is asked with a ping, a full one with a
write (a full etcd answers pings at once, so a ping would end the wait and the next
round's write would fail again), and each wait ends when its question is answered."""

from __future__ import annotations

import logging
import threading

import pytest

from elastic_runner.agent import etcd_outage
from elastic_runner.errors import EtcdFull, EtcdUnavailable


class Events:
    def __init__(self):
        self.emitted: list[tuple[str, dict]] = []

    def emit(self, kind: str, **fields) -> None:
        self.emitted.append((kind, fields))


class Store:
    """Refuses `refusals` questions with `error`, then answers."""

    def __init__(self, refusals: int, error: EtcdUnavailable):
        self.asked: list[bool] = []
        self.refusals, self.error = refusals, error

    def ping(self, write: bool = False) -> None:
        self.asked.append(write)
        if len(self.asked) <= self.refusals:
            raise self.error


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(etcd_outage, "ETCD_RETRY_S", 0.01)
    monkeypatch.setattr(etcd_outage, "FULL_RETRY_S", 0.01)


@pytest.mark.parametrize("error,write,until", [
    (EtcdFull("etcd at X is full and refused a transaction (...): compact ..."), True,
     "for etcd to accept writes"),
    (EtcdUnavailable("no answer from etcd for 9 s (grace 4 s)"), False, "for etcd"),
])
def test_the_wait_asks_the_question_the_error_raised_and_ends_when_answered(
        error, write, until, caplog):
    store, events = Store(refusals=3, error=error), Events()
    with caplog.at_level(logging.WARNING, logger="elastic_runner"):
        etcd_outage.wait_for_etcd(store, events, threading.Event(), 30.0, error)
    assert store.asked == [write] * 4
    assert events.emitted == [("etcd_lost", {"error": str(error)})]
    assert caplog.records[0].getMessage() == (
        f"{error}; workers stopped, waiting up to 30 s {until}")


def test_a_full_etcd_past_the_join_timeout_ends_the_node_with_its_line():
    error = EtcdFull("etcd at X is full and refused a lease grant (...)")
    store = Store(refusals=10**6, error=error)
    with pytest.raises(EtcdFull, match="is full and refused a lease grant"):
        etcd_outage.wait_for_etcd(store, Events(), threading.Event(), 0.2, error)
    assert len(store.asked) > 1 and all(store.asked)
