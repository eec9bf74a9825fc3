"""The agent's signal handler takes no lock: a relay thread reacts to the signal.

Why: Python runs a signal handler in the main thread between two bytecodes, perhaps
while that thread holds a lock. The agent's reaction to a signal sets threading.Events
and wakes the etcd mirror's waiters. An Event's set() takes the plain Lock of the
Event's Condition, and the main thread holds that Lock for a moment after every timed
wait on the same Event (threading.Condition.wait takes it back before it returns). A
signal delivered to another thread is handled at the main thread's next bytecode
boundary, which may fall in that moment. The agent polls such an Event every 5 ms
while its workers re-form in place (reform_driver._wait), so a SIGTERM then could
deadlock the main thread on itself. Seen in a chaos soak: an agent given a spot notice
while its workers re-formed never left and never logged again, and the others waited
for its live node key.

Here the handler only writes the signal's number to a pipe (os.write is safe in a
handler). A daemon thread reads it and runs the reaction, taking locks as any thread
may.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

log = logging.getLogger("elastic_runner")


class SignalRelay:
    """Install `handler` with signal.signal; `react(signum)` runs in the relay thread."""

    def __init__(self, react: Callable[[int], None]):
        self._react = react
        self._closed = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # a handler must never block
        self._thread = threading.Thread(target=self._relay, name="signal relay",
                                        daemon=True)
        self._thread.start()

    def handler(self, signum: int, _frame) -> None:
        if self._closed:  # its descriptor number may name another file by now
            return
        try:
            os.write(self._write, bytes((signum,)))
        except OSError:  # a full pipe (a storm of signals; the first counts) or closed
            pass

    def _relay(self) -> None:
        try:
            while data := os.read(self._read, 64):
                for signum in data:
                    self._react_logged(signum)
        finally:
            os.close(self._read)

    def _react_logged(self, signum: int) -> None:
        """A failed reaction must not end the relay: the next signal still counts."""
        try:
            self._react(signum)
        except Exception:  # noqa: BLE001 - logged with its traceback
            log.exception("handling signal %d failed", signum)

    def close(self) -> None:
        """Stop the relay thread (its read ends once the write end is closed)."""
        if self._closed:
            return
        self._closed = True
        try:
            os.close(self._write)
        except OSError:
            return
        self._thread.join(timeout=5)
