"""etcd/keepalive.py with a fake stream: what makes it give up a stream, what it takes
for an answer, and that leases sharing a stream do not wait for one another."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest

from elastic_runner.etcd.keepalive import KeepAliveStream, StreamEnded


class FakeServer:
    """Answers each request on its stream from a thread of its own, as gRPC does.

    `ttl`: the TTL it answers; `silent`: lease ids it never answers; `delay_s`: how
    late an answer comes (etcd's gRPC proxy answers at its own next refresh);
    `answer_id`: answer about this lease instead; `end_after`: end the stream after
    that many answers; `in_turn`: answer one request at a time, as etcd does, reading
    the TTL when it starts on one and taking the next of these seconds over it."""

    def __init__(self):
        self.opened: list[object] = []
        self.ttl, self.silent, self.delay_s = 30, set(), 0.0
        self.answer_id, self.end_after = None, None
        self.in_turn: list[float] | None = None

    def open(self, owner, requests):
        self.opened.append(owner)
        answers: queue.Queue = queue.Queue()

        def serve():
            for count, request in enumerate(requests, 1):
                if request in self.silent:
                    continue
                if self.in_turn is not None:
                    ttl = self.ttl
                    time.sleep(self.in_turn.pop(0))
                    answers.put(SimpleNamespace(ID=request, TTL=ttl))
                    continue
                answer = SimpleNamespace(ID=self.answer_id or request, TTL=self.ttl)
                threading.Timer(self.delay_s, answers.put, args=(answer,)).start()
                if self.end_after == count:
                    time.sleep(self.delay_s + 0.05)
                    answers.put(None)
                    return

        def stream():
            while (answer := answers.get()) is not None:
                yield answer
        threading.Thread(target=serve, daemon=True).start()
        return stream()


def stream(server: FakeServer) -> KeepAliveStream:
    return KeepAliveStream(server.open, lambda lease_id: lease_id)


def test_refreshes_share_one_stream_until_the_client_is_replaced():
    server, first, second = FakeServer(), object(), object()
    keepalive = stream(server)
    assert [keepalive.refresh(7, 1.0, first) for _ in range(5)] == [30] * 5
    assert server.opened == [first]
    assert keepalive.refresh(7, 1.0, second) == 30  # re-authenticated: a new stream
    assert server.opened == [first, second]
    keepalive.close()


def test_a_silent_stream_is_given_up_after_two_misses_and_the_next_refresh_reopens():
    server, owner = FakeServer(), object()
    keepalive = stream(server)
    server.silent = {7}
    assert keepalive.refresh(7, 0.2, owner) is None
    assert keepalive.refresh(7, 0.2, owner) is None
    assert len(server.opened) == 1  # one miss may be a late answer: kept until the second
    server.silent = set()
    assert keepalive.refresh(7, 1.0, owner) == 30
    assert len(server.opened) == 2
    keepalive.close()


def test_answers_about_other_leases_show_the_stream_alive():
    server, owner = FakeServer(), object()
    keepalive = stream(server)
    server.answer_id = 99
    assert [keepalive.refresh(7, 0.2, owner) for _ in range(3)] == [None] * 3
    assert len(server.opened) == 1
    keepalive.close()


def test_an_ended_stream_is_given_up_at_once_and_a_gone_lease_is_said():
    server, owner = FakeServer(), object()
    keepalive = stream(server)
    server.end_after = 1
    assert keepalive.refresh(7, 1.0, owner) == 30
    started = time.monotonic()
    assert keepalive.refresh(7, 5.0, owner) is None
    assert time.monotonic() - started < 2.5  # the end is news: no wait for the deadline
    server.end_after, server.ttl = None, 0
    assert keepalive.refresh(7, 1.0, owner) == 0  # the lease is gone: said, not a failure
    assert len(server.opened) == 2
    keepalive.close()


def test_a_late_answer_is_taken_by_the_next_refresh_without_a_new_stream():
    """etcd's gRPC proxy: each answer comes 0.4 s after its request, past a 0.2 s
    deadline, and refreshes come 0.3 s apart (the interval). The first refresh
    misses; each one after gets the answer the one before missed, and the stream
    stays."""
    server, owner = FakeServer(), object()
    keepalive = stream(server)
    server.delay_s = 0.4
    got = []
    for _ in range(4):
        got.append(keepalive.refresh(7, 0.2, owner))
        time.sleep(0.3)
    assert got == [None, 29, 29, 29]  # 30 less the ~0.3 s the kept answer waited
    assert len(server.opened) == 1
    keepalive.close()


def test_a_prompt_answer_is_preferred_to_a_kept_one():
    """A kept answer said TTL 30; the lease is gone since. Where answers are prompt
    the refresh must say so now, not one interval later."""
    server, owner = FakeServer(), object()
    keepalive = stream(server)
    server.delay_s = 0.4
    assert keepalive.refresh(7, 0.2, owner) is None
    time.sleep(0.3)  # the TTL-30 answer arrived and is kept
    server.delay_s, server.ttl = 0.0, -1
    assert keepalive.refresh(7, 1.0, owner) == -1
    keepalive.close()


def test_a_late_answer_to_an_earlier_ask_is_not_taken_for_the_answer_to_this_one():
    """CI once saw a revoked lease refreshed on the stream with TTL 30. The first ask
    is answered late (a frozen server); the second is sent meanwhile and etcd, before
    the revoke, starts on it slowly. The first's answer must not pass for the
    second's, or the second's (TTL 30) is taken as the answer to the ask after the
    revoke."""
    server, owner = FakeServer(), object()
    keepalive = stream(server)
    server.in_turn = [1.0, 0.5, 0.0]
    assert keepalive.refresh(7, 0.2, owner) is None
    time.sleep(0.05)
    assert keepalive.refresh(7, 5.0, owner) == 30
    server.ttl = 0  # revoked
    assert keepalive.refresh(7, 5.0, owner) == 0
    assert len(server.opened) == 1
    keepalive.close()


def test_leases_sharing_a_stream_do_not_wait_for_one_another():
    """Lease 1 is never answered and waits out its 3 s; lease 2, asked meanwhile on
    the same stream, gets its answer at once (well before lease 1's wait is over,
    with room for a loaded machine)."""
    server, owner = FakeServer(), object()
    server.silent = {1}
    keepalive = stream(server)
    first = threading.Thread(target=keepalive.refresh, args=(1, 3.0, owner))
    first.start()
    time.sleep(0.1)
    started = time.monotonic()
    assert keepalive.refresh(2, 5.0, owner) == 30
    assert time.monotonic() - started < 2.0
    first.join()
    assert len(server.opened) == 1
    keepalive.close()


def test_a_stream_that_cannot_open_leaves_the_refresh_to_the_one_shot():
    def refuse(owner, requests):
        raise RuntimeError("no channel")
    assert KeepAliveStream(refuse, lambda lease_id: lease_id).refresh(7, 1.0, object()) is None


def test_the_one_shot_waits_for_its_answer_and_says_why_a_stream_ended():
    """The one-shot keeps its request side open until answered (etcd's gRPC proxy
    drops a stream whose client half-closed first), and it closes after."""
    server, owner = FakeServer(), object()
    keepalive = stream(server)
    server.delay_s = 0.3
    assert keepalive.one_shot(7, 1.0, owner) == 30
    server.silent = {7}
    assert keepalive.one_shot(7, 0.2, owner) is None
    assert len(server.opened) == 2  # each one-shot on a stream of its own

    def ended(owner, requests):
        return iter(())
    with pytest.raises(StreamEnded):
        KeepAliveStream(ended, lambda lease_id: lease_id).one_shot(7, 1.0, owner)


def test_a_kept_answer_counts_its_age_and_an_old_one_is_not_taken():
    """A kept answer stands for what is left of its TTL; after a freeze longer than
    that it is no refresh at all (the lease may be gone)."""
    server, owner = FakeServer(), object()
    keepalive = stream(server)
    server.ttl, server.delay_s = 1, 0.3
    assert keepalive.refresh(7, 0.1, owner) is None
    time.sleep(0.4)  # the TTL-1 answer came and is kept
    server.silent = {7}
    assert keepalive.refresh(7, 0.1, owner) == 1  # ~0.5 s of it left: still a refresh
    server.silent = set()
    assert keepalive.refresh(7, 0.1, owner) is None
    time.sleep(1.2)  # its answer came ~1.1 s ago: spent
    server.silent = {7}
    assert keepalive.refresh(7, 0.1, owner) is None
    keepalive.close()


def test_a_kept_answer_that_the_lease_is_gone_is_taken_whatever_its_age():
    server, owner = FakeServer(), object()
    keepalive = stream(server)
    server.ttl, server.delay_s = -1, 0.3
    assert keepalive.refresh(7, 0.1, owner) is None
    time.sleep(1.2)
    server.silent = {7}
    assert keepalive.refresh(7, 0.1, owner) == -1
    keepalive.close()
