"""A lease and its keep-alive loop.

No etcd client refreshes leases for us, and a silent expiry is exactly how a node
gets dropped from a job without noticing. So the loop reports loss explicitly
(`lost` is set and the callback runs) instead of hiding it behind retries.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from elastic_runner.config import keepalive_interval_s
from elastic_runner.errors import EtcdError
from elastic_runner.etcd.client import EtcdClient

log = logging.getLogger(__name__)


class KeptLease:
    """A granted lease refreshed on a daemon thread (config.keepalive_interval_s: TTL/3)."""

    def __init__(self, client: EtcdClient, ttl_s: int,
                 on_lost: Callable[[], None] | None = None):
        self._client = client
        self.ttl_s = ttl_s
        self._on_lost = on_lost
        self.id = client.grant_lease(ttl_s)
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._last_refresh = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name=f"lease {self.id:x}", daemon=True)
        self._thread.start()

    def seconds_since_refresh(self) -> float:
        """How stale our view is: beyond the TTL the server may have dropped us."""
        return time.monotonic() - self._last_refresh

    def _loop(self) -> None:
        """Refresh every keep-alive interval; after a failed refresh, try again soon.

        Waiting another full interval after a failure left a single retry
        before the TTL ran out, so one slow answer from a busy etcd (or a
        CPU-starved host) cost the node its membership. Retries back off from
        50 ms up to the interval, so an error that answers at once cannot spin.
        """
        interval = keepalive_interval_s(self.ttl_s)
        pause, failures = interval, 0
        while not self._stop.wait(pause):
            try:
                remaining = self._client.refresh_lease(self.id, deadline_s=interval)
            except EtcdError as exc:
                log.debug("lease %x keep-alive failed: %s", self.id, exc)
                failures += 1
                pause = min(interval, 0.05 * 2 ** (failures - 1))
                continue
            if remaining <= 0:
                if not self._stop.is_set():  # not our own revoke, answered mid-refresh
                    self._mark_lost(f"etcd answered the keep-alive with TTL {remaining}")
                return
            self._last_refresh = time.monotonic()
            pause, failures = interval, 0

    def mark_lost(self, why: str) -> None:
        """etcd refused a write under this lease (lease not found): it is gone, whatever
        the keep-alive loop last heard; the owner registers again with a new one."""
        self._stop.set()
        if not self.lost.is_set():
            self._mark_lost(why)

    def _mark_lost(self, why: str) -> None:
        log.warning("lease %x expired (%s): this node is no longer a member", self.id, why)
        self.lost.set()
        if self._on_lost:
            self._on_lost()

    def revoke(self) -> None:
        """Drop the lease now so peers re-form at once instead of after the TTL."""
        self._stop.set()
        if self.lost.is_set():
            return
        try:
            self._client.revoke_lease(self.id, deadline_s=min(self.ttl_s, 3))
        except EtcdError as exc:
            log.warning("could not revoke lease %x (%s); peers will see it expire", self.id, exc)

    def stop(self) -> None:
        self._stop.set()
