"""While `fn(state)` trains: fail a collective at once when the agent says the round is broken.

Why: a gloo collective waits for a frozen peer (SIGSTOP: socket open, no answer)
until the collective timeout, max(10, 4 x --lease-ttl) s, though the agents know
within one lease TTL that the member is gone. Gloo can also miss a peer that left:
seen in the chaos soak, a survivor of a SIGKILL sat in a send for the whole 12 s
timeout after every other rank had failed its collective and left the group,
while its agent knew of the suspicion within 0.2 s. When the agent re-forms for a
lost or suspected member it marks its pause request "broken" (reform.py); a thread
polls for that and cuts this process's group connections (abort.GroupSockets), and
the blocked collective fails with gloo's own "Connection closed" error: the usual
collective-error path of elastic.py, at once. On NCCL the same thread aborts the
groups' communicators (abort.abort_nccl_communicators), which NCCL's own watchdog
would do only after the collective timeout. A graceful change (a notice, a
newcomer) is no reason: the workers pause at the agreed step boundary, nothing
re-done.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from elastic_runner.reform import ReformChannel
from elastic_runner.worker.abort import GroupSockets, abort_nccl_communicators

log = logging.getLogger("elastic_runner.worker.runtime")

POLL_S = 0.1  # one small file read per poll; a blocked collective waits at most this


class BrokenRoundWatch:
    """A context manager around one call of the training function."""

    def __init__(self, channel: ReformChannel, current_round: Callable[[], int],
                 sockets: GroupSockets, poll_s: float = POLL_S,
                 abort_nccl: Callable[[], int] = lambda: abort_nccl_communicators(log)):
        self._channel, self._current_round = channel, current_round
        self._sockets, self._poll_s = sockets, poll_s
        self._abort_nccl = abort_nccl
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="broken-round watch",
                                        daemon=True)

    def __enter__(self) -> "BrokenRoundWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(self._poll_s):
            round_number = self._current_round()
            if self._channel.broken(round_number):
                self._break(round_number)
                return

    def _break(self, round_number: int) -> None:
        """Fail whatever collective waits on the lost member: gloo's connections are
        cut, NCCL's communicators aborted (a job may hold both: the step boundary's
        group is gloo)."""
        try:
            cut = self._sockets.cut()
        except OSError as error:  # that collective then fails or times out as before
            log.warning("round %d is broken, but cutting its group failed: %s",
                        round_number, error)
            cut = 0
        aborted = self._abort_nccl()
        nccl = f" and aborted {aborted} NCCL group(s)" if aborted else ""
        log.warning("round %d is broken (a member is lost): cut %d connection(s)%s of its "
                    "group so that no collective waits for it", round_number, cut, nccl)
