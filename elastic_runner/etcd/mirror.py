"""A local copy of one etcd prefix, kept current by a single watch.

Why: every agent evaluates the rendezvous rules on the same state. Re-reading the
prefix on each notification would cost O(N) reads per change per agent (O(N^2)
per round); applying watch events to a copy costs one watch per agent, so etcd's
load grows linearly with the number of nodes.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from elastic_runner.etcd.client import EtcdClient, KeyValue, WatchEvent


class PrefixMirror:
    def __init__(self, client: EtcdClient, prefix: str,
                 ignore: Callable[[str], bool] = lambda key: False):
        self._client = client
        self.prefix = prefix
        # Keys under the prefix that decide nothing here (bulk data written by
        # others) are not copied and do not wake waiters.
        self._ignore = ignore
        self._entries: dict[str, KeyValue] = {}
        self._revision = 0
        # Bumped on every change or wake(): a waiter that read generation g before
        # evaluating state sleeps only while nothing has happened since g.
        self._generation = 0
        self._changed = threading.Condition()
        self._watch = None

    def start(self) -> None:
        entries, revision = self._client.get_prefix(self.prefix)
        with self._changed:
            self._entries = {kv.key: kv for kv in entries if not self._ignore(kv.key)}
            self._revision = revision
        self._watch = self._client.watch_prefix(self.prefix, revision + 1, self._apply)

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    def _apply(self, events: list[WatchEvent]) -> None:
        events = [e for e in events if not self._ignore(e.key)]
        if not events:
            return
        with self._changed:
            for event in events:
                if event.mod_revision <= self._revision:
                    continue  # already in the snapshot
                if event.kind == "delete":
                    self._entries.pop(event.key, None)
                else:
                    self._entries[event.key] = KeyValue(
                        event.key, event.value, event.create_revision, event.mod_revision,
                        event.version, event.lease)
            self._revision = max(self._revision, events[-1].mod_revision)
            self._generation += 1
            self._changed.notify_all()

    @property
    def revision(self) -> int:
        with self._changed:
            return self._revision

    def get(self, key: str) -> KeyValue | None:
        with self._changed:
            return self._entries.get(key)

    def under(self, prefix: str) -> list[KeyValue]:
        with self._changed:
            return sorted((kv for k, kv in self._entries.items() if k.startswith(prefix)),
                          key=lambda kv: kv.key)

    @property
    def generation(self) -> int:
        with self._changed:
            return self._generation

    def wait(self, timeout_s: float, generation: int) -> None:
        """Sleep until something changed after `generation`, or the timeout."""
        with self._changed:
            self._changed.wait_for(lambda: self._generation != generation,
                                   timeout=max(timeout_s, 0))

    def wait_revision(self, revision: int, timeout_s: float) -> bool:
        """Wait until our copy includes `revision` (e.g. our own write)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._revision >= revision,
                                          timeout=max(timeout_s, 0))

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(remaining)
            return True

    def wake(self) -> None:
        """Let waiters re-check conditions that are not etcd state (signals, timers)."""
        with self._changed:
            self._generation += 1
            self._changed.notify_all()
