"""etcd/keepalive.py with a fake stream: what makes it give up a stream, and reopen one."""

from __future__ import annotations

from types import SimpleNamespace

from elastic_runner.etcd.keepalive import KeepAliveStream


class FakeServer:
    """Answers each request on the stream it came on; `ttl`/`answer_id`/`silent` steer it."""

    def __init__(self):
        self.opened: list[object] = []
        self.ttl, self.answer_id, self.silent, self.end_after = 30, None, False, None

    def open(self, owner, requests):
        self.opened.append(owner)

        def answers():
            for count, request in enumerate(requests, 1):
                if self.silent:
                    continue
                yield SimpleNamespace(ID=self.answer_id or request, TTL=self.ttl)
                if self.end_after == count:
                    return
        return answers()


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


def test_a_silent_ended_or_confused_stream_is_given_up_and_the_next_refresh_reopens():
    server, owner = FakeServer(), object()
    keepalive = stream(server)
    server.silent = True
    assert keepalive.refresh(7, 0.2, owner) is None
    server.silent, server.answer_id = False, 99  # an answer about another lease
    assert keepalive.refresh(7, 1.0, owner) is None
    server.answer_id, server.end_after = None, 1  # the server ends the stream
    assert keepalive.refresh(7, 1.0, owner) == 30
    assert keepalive.refresh(7, 1.0, owner) is None
    server.end_after, server.ttl = None, 0  # the lease is gone: said, not a failure
    assert keepalive.refresh(7, 1.0, owner) == 0
    assert len(server.opened) == 4  # silent, confused, ended after one answer, the last
    keepalive.close()


def test_a_stream_that_cannot_open_leaves_the_refresh_to_the_old_way():
    def refuse(owner, requests):
        raise RuntimeError("no channel")
    assert KeepAliveStream(refuse, lambda lease_id: lease_id).refresh(7, 1.0, object()) is None


def test_leases_that_share_a_client_wait_for_the_stream_only_within_their_deadline():
    """One lease's refresh on a silent stream holds the lock for its half-deadline;
    the lease queued behind it gives up the stream within its own deadline (and then
    refreshes the old way), instead of adding one wait per lease ahead of it."""
    import threading
    import time

    server, owner = FakeServer(), object()
    server.silent = True
    keepalive = stream(server)
    first = threading.Thread(target=keepalive.refresh, args=(1, 2.0, owner))
    first.start()
    time.sleep(0.1)
    started = time.monotonic()
    assert keepalive.refresh(2, 0.5, owner) is None
    assert time.monotonic() - started < 1.0  # not the 2 s the first one may hold the stream
    first.join()
    keepalive.close()
