"""Asking the rendezvous about members while the workers pause or form a round (issue 15).

Why: while the workers train, the agent's monitor asks the rendezvous every tick
whether the plan still holds. During an in-place re-formation the agent waits on its
workers instead: first for them to pause at a step boundary, then for them to form
the new round's group. A member lost meanwhile holds either wait, though the
deputies know within a lease TTL:
- while pausing, a member that froze after the new round closed holds the collective
  in flight until it thaws (seen in a chaos soak: 6.7 s without a step, the others'
  pause waiting out the whole freeze while the newcomer's agent had long seen the
  loss); the round the workers are leaving is then cut, as for any loss;
- while forming, a member reclaimed or crashed after the round closed never comes to
  the group; the round is called off, and the next one starts from there.
A `LossWatch` asks the rendezvous as the monitor does, at most every LOOK_EVERY_S,
and acts once.
"""

from __future__ import annotations

import time
from typing import Callable

from elastic_runner.agent.ports import Rendezvous
from elastic_runner.rendezvous.protocol import Cause, CauseKind, Plan


class LossWatch:
    """Acts once `counts` a cause the rendezvous gives for `new` (the round being
    paused for, or formed); with `notices`, a peer's announced departure counts too."""

    LOOK_EVERY_S = 0.05

    def __init__(self, rendezvous: Rendezvous, node_id: str, new: Plan,
                 counts: Callable[[Cause], bool], act: Callable[[Cause], None],
                 notices: bool):
        self._rendezvous, self._node_id, self._new = rendezvous, node_id, new
        self._counts, self._act, self._notices = counts, act, notices
        self._next_look = 0.0
        self.seen: Cause | None = None

    def check(self, left: list[int]) -> list[int]:
        """`left` (the local ranks still pausing or forming), after acting if due."""
        now = time.monotonic()
        if not left or self.seen is not None or now < self._next_look:
            return left
        self._next_look = now + self.LOOK_EVERY_S
        cause = self._lost_member()
        if cause is not None:
            self.seen = cause
            self._act(cause)
        return left

    def _lost_member(self) -> Cause | None:
        cause = self._rendezvous.change_reason(self._new)
        if cause is not None and self._counts(cause):
            return cause
        if not self._notices:
            return None
        leaving = [other for other in self._rendezvous.notices(self._new)
                   if other != self._node_id]
        return Cause(CauseKind.NOTICE, ",".join(leaving)) if leaving else None
