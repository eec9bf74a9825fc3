"""A local copy of one etcd prefix, kept current by a single watch.

Why: every agent evaluates the rendezvous rules on the same state. Re-reading the
prefix on each notification would cost O(N) reads per change per agent (O(N^2)
per round); applying watch events to a copy costs one watch per agent, so etcd's
load grows linearly with the number of nodes. The copy is also indexed by
directory: at a thousand agents, scanning every key on each evaluation (all
rounds' joins, all nodes) was most of an agent's CPU.

The copy also records when this agent first saw each key, on its own monotonic
clock: timestamps written by other machines are not comparable with ours (their
wall clocks drift and step), but "how long ago did I see this node register" is
measured on one clock. A key already there when the copy was read counts as
first seen then: it may be older, and nothing here can tell how much.

A copy may start narrow: only the keys in one range of the prefix (`narrow`),
those every agent needs. Why: at a thousand agents, each of a round's thousand
join writes went to a thousand full copies, a million events per round; most
agents only need the round key, and only the few that decide (rendezvous
deputies) widen their copy to the whole prefix.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from elastic_runner.errors import EtcdError
from elastic_runner.etcd.client import EtcdClient, KeyValue, WatchEvent

log = logging.getLogger(__name__)


class PrefixMirror:
    def __init__(self, client: EtcdClient, prefix: str,
                 ignore: Callable[[str], bool] = lambda key: False,
                 clock: Callable[[], float] = time.monotonic,
                 narrow: tuple[str, str] | None = None):
        self._client = client
        # The key range [start, end) copied while narrow; None: the whole prefix.
        self._narrow = narrow
        self._clock = clock
        self.prefix = prefix
        # Keys under the prefix that decide nothing here (bulk data written by
        # others) are not copied and do not wake waiters.
        self._ignore = ignore
        self._entries: dict[str, KeyValue] = {}
        self._directories: dict[str, dict[str, KeyValue]] = {}
        self._deletions: dict[str, int] = {}
        # key -> (create revision, our clock when we first saw that incarnation).
        self._first_seen: dict[str, tuple[int, float]] = {}
        self._revision = 0
        # Bumped on every change or wake(): a waiter that read generation g before
        # evaluating state sleeps only while nothing has happened since g.
        self._generation = 0
        self._changed = threading.Condition()
        self._watch = None
        self._stopped = False
        # One resync at a time: the engine's and a compacted watch's could overlap.
        self._resync_lock = threading.Lock()
        # Which watch feeds the copy: events of an earlier one (cancelled by a resync,
        # still delivering for a moment, or over other keys) must not be applied.
        self._epoch = 0
        # Watch events the current watch delivered (before `ignore`): what etcd sent.
        self.events_delivered = 0

    @property
    def wide(self) -> bool:
        """Whether the copy holds the whole prefix (else only its narrow range)."""
        return self._narrow is None

    def widen(self) -> None:
        """Copy the whole prefix from now on (one read of it, then one wider watch)."""
        if self._narrow is not None:
            self._narrow = None
            self.resync()

    def start(self, snapshot: tuple[Sequence[KeyValue], int] | None = None) -> None:
        """Read the copied range, then watch it from the revision after that read.

        `snapshot`: (the narrow range's keys, the revision read at), read by the caller
        in a transaction it sent anyway (registration): no read of our own. Why:
        a thousand agents starting at once each sent one more request, and their
        separate reads came before the first agent had created the round and the
        deputy slots, so nearly all of them raced to create those too.
        """
        if snapshot is not None and self._narrow is not None:
            entries, revision = snapshot
        elif self._narrow is None:
            entries, revision = self._client.get_prefix(self.prefix)
        else:
            entries, revision = self._client.get_range(*self._narrow)
        now = self._clock()
        with self._changed:
            self._entries, self._directories = {}, {}
            for kv in entries:
                if not self._ignore(kv.key):
                    self._store(kv, now)
            # A resync keeps what it saw before for keys that are still the same.
            self._first_seen = {key: seen for key, seen in self._first_seen.items()
                                if key in self._entries}
            self._revision = revision
            self._epoch += 1
            epoch = self._epoch

        def apply(events: list[WatchEvent]) -> None:
            self._apply(events, epoch)
        if self._narrow is None:
            self._watch = self._client.watch_prefix(self.prefix, revision + 1, apply,
                                                    self._read_again_after_compaction)
        else:
            self._watch = self._client.watch_range(*self._narrow, revision + 1, apply,
                                                   self._read_again_after_compaction)

    def stop(self) -> None:
        self._stopped = True
        with self._resync_lock:  # a resync under way ends first, and none starts after
            self._cancel_watch()

    def _cancel_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    def resync(self) -> None:
        """Throw the copy away and read the prefix again, then watch from there.

        For a copy found to disagree with etcd: a watch that lost events (seen
        with pyetcd when several watches share one client and a create times
        out) would otherwise go on reporting live nodes as gone.
        """
        with self._resync_lock:
            if self._stopped:  # no new watch for a copy nobody reads any more
                return
            self._cancel_watch()
            self.start()
        self.wake()

    def _read_again_after_compaction(self, revision: int) -> None:
        """Our watch resumed past events etcd had already compacted (a stream broken
        after a long quiet): only a new read tells what changed meanwhile. Runs in the
        old watch's own thread, and tries until etcd answers: nothing else would bring
        a copy back that nobody compares with etcd (a non-deciding agent's)."""
        backoff_s = 0.1
        while not self._stopped:
            try:
                self.resync()
                return
            except EtcdError as exc:
                log.warning("reading %s again after etcd's compaction failed (%s); "
                            "retrying in %.1f s", self.prefix, exc, backoff_s)
                time.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 2.0)

    def _apply(self, events: list[WatchEvent], epoch: int) -> None:
        now = self._clock()
        with self._changed:
            if epoch != self._epoch:
                return
            self.events_delivered += len(events)
            events = [e for e in events if not self._ignore(e.key)]
            if not events:
                return
            for event in events:
                if event.mod_revision <= self._revision:
                    continue  # already in the snapshot
                if event.kind == "delete":
                    self._drop(event.key)
                else:
                    self._store(KeyValue(event.key, event.value, event.create_revision,
                                         event.mod_revision, event.version, event.lease), now)
            self._revision = max(self._revision, events[-1].mod_revision)
            self._generation += 1
            self._changed.notify_all()

    def _store(self, kv: KeyValue, now: float) -> None:
        seen = self._first_seen.get(kv.key)
        if seen is None or seen[0] != kv.create_revision:
            self._first_seen[kv.key] = (kv.create_revision, now)
        self._entries[kv.key] = kv
        self._directories.setdefault(_directory(kv.key), {})[kv.key] = kv

    def _drop(self, key: str) -> None:
        self._entries.pop(key, None)
        self._first_seen.pop(key, None)
        directory = _directory(key)
        self._deletions[directory] = self._deletions.get(directory, 0) + 1
        siblings = self._directories.get(directory)
        if siblings is not None:
            siblings.pop(key, None)
            if not siblings:
                del self._directories[directory]

    @property
    def revision(self) -> int:
        with self._changed:
            return self._revision

    def get(self, key: str) -> KeyValue | None:
        with self._changed:
            return self._entries.get(key)

    def first_seen(self, key: str) -> float | None:
        """When this copy first saw the key's current incarnation, on our clock.

        A key deleted and created again is new. Keys found when the copy was read
        (start or resync) count as seen then. None when the copy lacks the key.
        """
        with self._changed:
            seen = self._first_seen.get(key)
            return seen[1] if seen is not None else None

    def first_seen_in(self, directory: str) -> dict[str, float]:
        """`first_seen` of every key directly inside `directory`, under one lock."""
        with self._changed:
            return {key: self._first_seen[key][1]
                    for key in self._directories.get(directory, {}) if key in self._first_seen}

    def children(self, directory: str) -> list[KeyValue]:
        """The keys directly inside `directory` (ending in "/"), in key order."""
        with self._changed:
            return sorted(self._directories.get(directory, {}).values(), key=lambda kv: kv.key)

    def census(self, directory: str) -> tuple[int, int]:
        """(keys now in `directory`, deletions seen there so far), in O(1).

        Lets a waiter tell "someone left" or "the count reached N" from "more of
        the same arrived" without reading every key again.
        """
        with self._changed:
            return len(self._directories.get(directory, ())), self._deletions.get(directory, 0)

    @property
    def generation(self) -> int:
        with self._changed:
            return self._generation

    def wait(self, timeout_s: float, generation: int) -> bool:
        """Sleep until something changed after `generation` (True), or the timeout."""
        with self._changed:  # no wait_for: every agent calls this each monitor tick
            if self._generation == generation:
                self._changed.wait(max(timeout_s, 0))
            return self._generation != generation

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


def _directory(key: str) -> str:
    return key[:key.rfind("/") + 1]
