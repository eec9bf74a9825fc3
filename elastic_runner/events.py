"""Structured membership events: one JSON line each, locally and in etcd.

Why both: the local file (`--log-dir/events.jsonl`) survives etcd and feeds
`elastic-run report`; the bounded etcd copy lets `elastic-run status` show the
recent history of a run from any machine. Emitting never raises: losing an event
must not stop training.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"


class EventLog:
    def __init__(self, node_id: str, run_id: str, path: Path | None = None,
                 publish: Callable[[dict], None] | None = None):
        self._node_id = node_id
        self._run_id = run_id
        self.path = path
        self._publish = publish
        self._lock = threading.Lock()
        self._listeners: list[Callable[[dict], None]] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def subscribe(self, listener: Callable[[dict], None]) -> None:
        """Call `listener(record)` for every event (metrics are one listener)."""
        self._listeners.append(listener)

    def emit(self, kind: str, **fields) -> dict:
        record = {"time": time.time(), "run_id": self._run_id, "node": self._node_id,
                  "kind": kind, **fields}
        line = json.dumps(record, sort_keys=True, default=str)
        with self._lock:
            if self.path is not None:
                try:
                    append_line(self.path, line)
                except OSError as exc:
                    log.debug("event not written to %s: %s", self.path, exc)
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:  # a broken listener must not stop the agent
                log.debug("event listener failed", exc_info=True)
        if self._publish is not None:
            try:
                self._publish(record)
            except Exception as exc:  # etcd down: the local copy is enough
                log.debug("event %s not published: %s", kind, exc)
        return record


# Where a file system has no POSIX locks, appends go on without one.
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)
_HELD = (errno.EAGAIN, errno.EACCES)
# The longest an append waits for another writer's lock. Writers hold it for one line;
# one that died holding it on NFS keeps it until its lease ends (90 s on NFSv4), and an
# agent's loop must not stall that long for an event: then the line goes in without.
LOCK_WAIT_S = 1.0


def append_line(path: Path, line: str) -> None:
    """Append one line to a file that other processes, on other machines too, append to.

    Why the lock: one --log-dir often serves every node (a shared folder), and on NFS
    O_APPEND is not atomic across clients (open(2)): each client writes at the end it
    last saw, so two nodes' events overwrite each other. Under a POSIX lock the NFS
    client looks up the size again and writes before releasing it. On a file system
    without locks (NFS mounted `nolock`), or a lock held past LOCK_WAIT_S, the line
    is appended as before.
    """
    with open(path, "a") as handle:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno in _NO_LOCKS or (exc.errno in _HELD and
                                              time.monotonic() >= deadline):
                    break
                if exc.errno not in _HELD:
                    raise
                time.sleep(0.01)
        handle.write(line + "\n")
        handle.flush()  # before close() releases the lock


def read_jsonl(path: Path) -> list[dict]:
    """The records of a file other processes append to; a line cut short (being
    written, or by a crash) is skipped. A missing file has no records."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def read_events(path: Path) -> list[dict]:
    """Events of a log file in time order."""
    return sorted(read_jsonl(path), key=lambda e: e.get("time", 0))
