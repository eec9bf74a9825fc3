"""etcd/lease.py's loop with a fake client: what it reports, and what it must not."""

from __future__ import annotations

import logging
import threading
import time

from elastic_runner.etcd.lease import KeptLease


class RevokeMidRefresh:
    """A refresh that is answered only after the lease is revoked, as through etcd's
    gRPC proxy, where a keep-alive waits up to a third of the TTL for its answer."""

    def __init__(self):
        self.refreshing, self.revoked = threading.Event(), threading.Event()

    def grant_lease(self, ttl_s: int) -> int:
        return 7

    def refresh_lease(self, lease_id: int, deadline_s: float) -> int:
        self.refreshing.set()
        self.revoked.wait(10)
        return -1  # what etcd says of a revoked lease

    def revoke_lease(self, lease_id: int, deadline_s: float | None = None) -> None:
        self.revoked.set()


def test_our_own_revoke_answered_mid_refresh_is_not_a_lost_lease(caplog):
    client = RevokeMidRefresh()
    lost = threading.Event()
    lease = KeptLease(client, ttl_s=1, on_lost=lost.set)  # refreshes from 0.33 s on
    assert client.refreshing.wait(5)
    with caplog.at_level(logging.WARNING):
        lease.revoke()
        time.sleep(0.3)
    assert not lease.lost.is_set() and not lost.is_set()
    assert "expired" not in caplog.text


def test_a_lease_gone_by_others_is_reported_lost():
    client = RevokeMidRefresh()
    lost = threading.Event()
    lease = KeptLease(client, ttl_s=1, on_lost=lost.set)
    assert client.refreshing.wait(5)
    client.revoked.set()  # dropped by someone else: the TTL ran out, an operator
    assert lost.wait(5) and lease.lost.is_set()
