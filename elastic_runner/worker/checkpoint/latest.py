"""The record of the newest verified checkpoint, and how a bad one is retracted.

Why a record outside the checkpoint files: a fenced writer (its round is over) can
still write files, but it must not make them the ones everybody resumes from. So the
record is a compare-and-swap value (in etcd for real jobs, `EtcdLatestStore` in
etcd_store.py) that only moves forward, and it fences stale writers.

Why retraction: a record whose checkpoint later fails verification (a flipped bit on
storage) would otherwise fence the job out of its own past: readers fall back to an
older step, but re-saving the steps after it is refused as "stale" and the job
crash-loops. The reader that falls back replaces the bad record, compare-and-swap
against exactly the bad record, by the record of the checkpoint it fell back to, or
by `NO_CHECKPOINT` when there is none. Racing readers agree: the first swap wins, the
others find the record changed and leave it. `NO_CHECKPOINT` (rather than deleting the
key) keeps the answer "nothing verified below the bad step" for readers that read
after the swap; without it they would scan every step, including unpublished ones
above the bad record, and could resume from a step the others ignore.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Protocol, runtime_checkable

# Stands in for a retracted record when nothing older verifies: fences nothing
# (step -1 is below every step) and names no checkpoint.
NO_CHECKPOINT: dict[str, Any] = {"url": None, "step": -1, "sha256": None, "world_size": None}


def names_no_checkpoint(record: Mapping[str, Any]) -> bool:
    return record.get("sha256") is None


@runtime_checkable
class LatestStore(Protocol):
    """Compare-and-swap record of the newest verified checkpoint (e.g. in etcd).

    publish() refuses a record that would move the history backwards (or that a
    fenced writer sends); retract(bad, replacement) swaps the record only while it
    is still exactly `bad`, so it is safe for every reader to try it.
    """

    def read(self) -> dict[str, Any] | None: ...

    def publish(self, record: dict[str, Any]) -> bool: ...

    def retract(self, bad: dict[str, Any], replacement: dict[str, Any]) -> bool: ...


def refuses(current: Mapping[str, Any] | None, record: Mapping[str, Any]) -> bool:
    """A lower step, or an equal step with another sha256 (two writers disagree)."""
    if current is None:
        return False
    return record["step"] < current["step"] or (
        record["step"] == current["step"] and record["sha256"] != current["sha256"])


class MemoryLatestStore:
    """In-process `LatestStore` for tests and single-node runs.

    The identical record is accepted again so a retried save is idempotent.
    """

    def __init__(self, record: Mapping[str, Any] | None = None) -> None:
        self._lock = threading.Lock()
        self._record = dict(record) if record is not None else None

    def read(self) -> dict[str, Any] | None:
        with self._lock:
            return None if self._record is None else dict(self._record)

    def publish(self, record: dict[str, Any]) -> bool:
        with self._lock:
            if refuses(self._record, record):
                return False
            self._record = dict(record)
            return True

    def retract(self, bad: dict[str, Any], replacement: dict[str, Any]) -> bool:
        with self._lock:
            if self._record != bad:
                return False
            self._record = dict(replacement)
            return True
