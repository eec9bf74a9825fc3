"""The checkpoint record, read by the agent for its workers: the local channel's one request.

Why: every rank reads the record of the newest verified checkpoint when it loads
(checkpoint/latest.py). On its own etcd connection, that is one gRPC channel, one
connection and one read per worker per start: at 1,024 nodes x 8 workers 3.0-4.0 s of
etcd CPU on every start and restart, and in every worker about 0.2 s of CPU to import
the etcd client (bench/checkpoint_record_reads.py: 0.8-0.9 s and 5 ms through the
agent). The agent already
holds a connection; it answers its workers over a Unix socket in its private scratch
folder, and one etcd read serves every worker that asked before it began.

Why not a copy the agent hands out (the environment, a file kept by a watch): a rank
that reads after rank 0 published, and after a collective that orders the two (save,
barrier, load), must see the new record, or the ranks load different steps and diverge
without a word. A read that begins after the request arrived is as fresh as the
worker's own read was: the record cannot move between the ask and the read unnoticed.

The protocol: the worker connects, sends `latest\\n`, and reads one JSON line until the
agent closes: {"record": <record or null>} or {"error": <line>, "kind": <error type>}.
Writes (publish, retract) stay on the writer's own client: only rank 0 makes them,
and they are fenced by its round. Rank 0 of a start reads through that client too
(job_checkpointer._etcd_store), so that its save for a resize finds it connected.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from elastic_runner.errors import EtcdAuthError, EtcdError, EtcdUnavailable

log = logging.getLogger(__name__)

RECORD_SOCKET = "record.sock"  # in the agent's scratch folder
REQUEST = b"latest\n"
# How long a worker waits for its agent's answer. The agent answers within its etcd
# client's retry deadline (its etcd grace) or says why not; only a frozen agent is
# slower, and its node is then re-formed out of the job anyway.
ANSWER_TIMEOUT_S = 120.0
# How long a read waits for the rest of the node's workers to ask: they reach their
# load within tens of milliseconds of each other; a script where only some ranks load
# pays this once per load.
GATHER_WINDOW_S = 0.05
# How long the agent waits for a connected worker's request line.
REQUEST_TIMEOUT_S = 10.0
_LONGEST_ANSWER = 1 << 20
_ERRORS = {cls.__name__: cls for cls in (EtcdError, EtcdUnavailable, EtcdAuthError)}

Record = dict[str, Any]


def read_json(client: Any, key: str) -> Callable[[], Record | None]:
    """The record as read by an EtcdClient (any object with its get())."""
    def read() -> Record | None:
        found = client.get(key)
        return json.loads(found.value) if found is not None else None
    return read


class CoalescedRead:
    """One read at a time; a caller is answered by a read that began after it called.

    Why: a node's workers ask within milliseconds of each other, and etcd spends about
    as much on one linearizable read over an open connection (0.35 ms) as on a new
    connection and its read (0.47 ms; bench/checkpoint_record_reads.py). So a read
    waits up to `window_s` for the node's other workers to ask, and starts at once when
    `expected` have: a node costs etcd one read per start instead of one per worker,
    and no answer predates its question.
    """

    def __init__(self, read: Callable[[], Record | None], expected: int = 1,
                 window_s: float = 0.0):
        self._read, self._expected, self._window_s = read, expected, window_s
        self._changed = threading.Condition()
        self._begun = 0  # reads begun so far
        self._done = 0  # reads finished so far (== _begun or _begun - 1)
        self._askers = 0  # callers waiting for read _begun + 1
        self._gathering = False  # a caller is waiting for the others before it reads
        self._answer: tuple[Record | None, BaseException | None] = (None, None)

    def __call__(self) -> Record | None:
        with self._changed:
            needed = self._begun + 1  # the first read that begins after this call
            self._askers += 1
            self._changed.notify_all()  # a gathering caller counts us
            while self._done < needed:
                if self._done == self._begun and not self._gathering:
                    self._gather()
                    self._begun += 1
                    self._askers = 0
                    self._read_for_everyone()
                else:
                    self._changed.wait()
            record, error = self._answer
        if error is not None:
            raise error
        return record

    def _gather(self) -> None:
        """Called with the lock held: wait for the expected askers or the window."""
        self._gathering = True
        deadline = time.monotonic() + self._window_s
        while self._askers < self._expected and (left := deadline - time.monotonic()) > 0:
            self._changed.wait(left)
        self._gathering = False

    def _read_for_everyone(self) -> None:
        """Called with the lock held; reads without it, so that askers can queue."""
        self._changed.release()
        try:
            answer = (self._read(), None)
        except Exception as error:  # every asker of this read gets it
            answer = (None, error)
        finally:
            self._changed.acquire()
        self._answer = answer
        self._done = self._begun
        self._changed.notify_all()


class RecordRelay:
    """The agent's side: a thread per asking worker, one etcd read per burst."""

    def __init__(self, listener: socket.socket, path: Path, read: CoalescedRead):
        self._listener, self.path, self._read = listener, path, read
        self._thread = threading.Thread(target=self._accept, name="elastic-run-record-relay",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, folder: Path, read: Callable[[], Record | None], workers: int = 1,
              window_s: float = GATHER_WINDOW_S) -> RecordRelay | None:
        """Listen in `folder` for this node's `workers`; None where the socket cannot be
        made (a path longer than AF_UNIX allows): the workers then read etcd themselves."""
        path = folder / RECORD_SOCKET
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(path))
            listener.listen(64)
        except OSError as error:
            listener.close()
            log.info("workers read the checkpoint record from etcd themselves: no socket "
                     "at %s (%s)", path, error)
            return None
        return cls(listener, path, CoalescedRead(read, workers, window_s))

    def close(self) -> None:
        """Shutting the listener down wakes its accept() at once (Linux: EINVAL)."""
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._thread.join()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._answer_one, args=(connection,), daemon=True,
                             name="elastic-run-record-answer").start()

    def _answer_one(self, connection: socket.socket) -> None:
        """Daemon thread: a worker that connects and never asks holds up nobody."""
        with connection:
            connection.settimeout(REQUEST_TIMEOUT_S)
            try:
                request = _receive_line(connection, len(REQUEST))
                connection.sendall(_answer(request, self._read))
            except OSError as error:  # the worker went away, or never asked
                log.debug("checkpoint record request not answered: %s", error)


def _receive_line(sock: socket.socket, most: int) -> bytes:
    """One message, either side's: up to its newline, the peer closing, or `most` bytes."""
    received = b""
    while len(received) < most and not received.endswith(b"\n"):
        chunk = sock.recv(min(most - len(received), 65536))
        if not chunk:
            break
        received += chunk
    return received


def _answer(request: bytes, read: Callable[[], Record | None]) -> bytes:
    if request != REQUEST:
        reply: dict[str, Any] = {"error": f"unknown request {request[:40]!r}",
                                 "kind": EtcdError.__name__}
    else:
        try:
            reply = {"record": read()}
        except EtcdError as error:
            reply = {"error": str(error), "kind": type(error).__name__}
        except Exception as error:  # the worker must hear why, not wait
            reply = {"error": f"the agent could not read the checkpoint record: {error}",
                     "kind": EtcdError.__name__}
    return json.dumps(reply).encode() + b"\n"


def ask_record(path: str, timeout_s: float = ANSWER_TIMEOUT_S) -> Record | None:
    """The worker's side. Raises OSError when no agent listens at `path` (the caller may
    read etcd itself), EtcdError (or a subtype) with the agent's line when it could not
    read, EtcdUnavailable when it did not answer in time."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(path)
        try:
            sock.sendall(REQUEST)
            line = _receive_line(sock, _LONGEST_ANSWER)
        except socket.timeout:  # (an OSError: caught before the caller's fallback sees it)
            raise EtcdUnavailable(f"the agent did not answer for the checkpoint record within "
                                  f"{timeout_s:g} s (its socket {path})") from None
    if not line:  # the agent is on its way out: its workers are about to be stopped
        raise ConnectionResetError(f"the agent closed {path} without an answer")
    try:
        reply = json.loads(line)
    except ValueError:
        raise EtcdError(f"the agent's answer for the checkpoint record is not JSON: "
                        f"{line[:80]!r}") from None
    if "error" in reply:
        raise _ERRORS.get(reply.get("kind"), EtcdError)(reply["error"])
    return reply["record"]
