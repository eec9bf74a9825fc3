"""A watch that resumes after server restarts, stream errors and compactions.

The library does not resume a watch after its stream breaks; we re-create it from
the last delivered revision + 1, so no event is lost or delivered twice. If etcd
compacted that revision meanwhile (keys quiet for longer than its auto-compaction
keeps), those events are gone and re-creating it failed forever: `on_compacted(revision)`
is called in our thread (the owner reads its keys again and may watch anew there,
which in the library's delivering thread would wait on a reply that thread has to
deliver), and we go on from the oldest revision etcd still has.

No import of the etcd library here (client.py is the one module that has it): the
client hands in how to open a watch and how to read what it delivers.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from elastic_runner.etcd.values import WatchEvent

log = logging.getLogger(__name__)


class Compacted(Exception):
    """etcd no longer has the revision a watch asked to start from."""

    def __init__(self, revision: int):
        super().__init__(f"compacted up to revision {revision}")
        self.revision = revision


# (prefix, range end or None, start revision, deliver) -> a function that cancels it;
# raises Compacted. Opened on the client current at the call (after a
# re-authentication the facade holds a new one).
OpenWatch = Callable[[str, "str | None", int, Callable[[Any], None]], Callable[[], None]]
# What the library delivered -> its events; None: the stream broke; raises Compacted.
ReadDelivery = Callable[[Any], "list[WatchEvent] | None"]


@dataclass
class PrefixWatch:
    open_watch: OpenWatch
    read_delivery: ReadDelivery
    prefix: str
    next_revision: int
    on_events: Callable[[list[WatchEvent]], None]
    # The end of the watched range (exclusive); None watches `prefix` as a prefix.
    range_end: str | None = None
    on_compacted: Callable[[int], None] | None = None
    _compacted_at: int = 0  # set by the library's thread, handled by ours
    _stopped: threading.Event = field(default_factory=threading.Event)
    _broken: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _cancel_current: Callable[[], None] | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"watch {self.prefix}", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._stopped.set()
        self._broken.set()
        if self._cancel_current is not None:
            try:
                self._cancel_current()
            except Exception:  # the stream may already be gone
                log.debug("watch cancel failed", exc_info=True)

    def _run(self) -> None:
        backoff = 0.05
        while not self._stopped.is_set():
            self._broken.clear()
            try:
                self._cancel_current = self.open_watch(self.prefix, self.range_end,
                                                       self.next_revision, self._deliver)
                backoff = 0.05
                if self._stopped.is_set():  # cancelled while it was being created
                    self._cancel_current()
                    return
            except Compacted as compacted:
                self._compacted_at = compacted.revision
            except Exception as exc:  # server down: retry until cancelled
                log.debug("watch on %s not created (%s); retrying", self.prefix, exc)
                self._stopped.wait(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            else:
                self._broken.wait()
            if self._compacted_at and not self._stopped.is_set():
                self._resume_after_compaction()

    def _resume_after_compaction(self) -> None:
        compacted, self._compacted_at = self._compacted_at, 0
        log.warning("etcd compacted its history up to revision %d before our watch of %s "
                    "resumed at %d; reading those keys again", compacted, self.prefix,
                    self.next_revision)
        self.next_revision = compacted
        if self.on_compacted is not None:
            self.on_compacted(compacted)

    def _deliver(self, response: Any) -> None:
        try:
            events = self.read_delivery(response)
        except Compacted as compacted:
            self._compacted_at = compacted.revision
            self._broken.set()
            return
        if events is None:
            log.debug("watch on %s broke (%s); re-creating from revision %d",
                      self.prefix, response, self.next_revision)
            self._broken.set()
            return
        if events:
            self.next_revision = events[-1].mod_revision + 1
            self.on_events(events)
