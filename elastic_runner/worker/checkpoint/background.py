"""The background writer of async checkpoints: one save in flight, none lost.

Why it needs care: an async save that fails must fail the worker, but nobody
waits on a background thread by default. concurrent.futures joins its threads
when the interpreter exits (so a pending write does finish) and then drops the
error, and the process exits 0 with its last checkpoint missing. So the error is
raised, once, by whichever comes first of the next save (`collect()`), a step
boundary (`collect(block=False)`), `close()`, or interpreter exit: an atexit
handler registered per writer (Python's registry, no state of ours) closes it
and, if the save failed, prints one line and ends the process with status 1,
because an atexit handler cannot change the exit status any other way. `close()`
unregisters it, so a closed writer costs nothing at exit.
"""

from __future__ import annotations

import atexit
import concurrent.futures as futures
import os
import sys
from typing import Any, Callable

from elastic_runner.errors import CheckpointError, CheckpointWriteError


class BackgroundWriter:
    """Runs one write at a time off the training thread; owned by a Checkpointer."""

    def __init__(self, exit_line: Callable[[BaseException], str]) -> None:
        """`exit_line(error)` is the line printed when a failed save ends the process."""
        self._executor = futures.ThreadPoolExecutor(1, "ckpt-writer")
        self._pending: tuple[int, futures.Future[None]] | None = None
        self._exit_line = exit_line
        self._closed = False
        atexit.register(self._at_exit)

    def submit(self, step: int, write: Callable[..., None], *args: Any) -> None:
        """Start `write(*args)`; the caller has collected the previous one."""
        self._pending = (step, self._executor.submit(write, *args))

    def settle(self) -> None:
        """Wait for the pending write without raising: its error stays for collect()."""
        if self._pending is not None:
            futures.wait([self._pending[1]])

    def collect(self, block: bool = True) -> None:
        """Raise the finished write's error once; `block`: wait for it first.

        Raises:
            CheckpointError: the write failed; other exceptions are wrapped in
                CheckpointWriteError so the worker's one-line report names the step.
        """
        if self._pending is None:
            return
        step, fut = self._pending
        if not block and not fut.done():
            return
        try:
            fut.result()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointWriteError(
                f"async save of checkpoint step {step} failed: {exc!r}") from exc
        finally:
            if fut.done():
                self._pending = None

    def close(self) -> None:
        """Finish the pending write and stop the thread; only the first call raises."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        try:
            self.collect()
        finally:
            self._executor.shutdown(wait=True)

    def _at_exit(self) -> None:
        try:
            self.close()
        except Exception as exc:
            print(self._exit_line(exc), file=sys.stderr, flush=True)
            try:
                sys.stdout.flush()
            finally:
                os._exit(1)
