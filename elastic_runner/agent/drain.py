"""How long the agent waits for its workers to stop at a step boundary.

Why a policy of its own: before a resize that loses nothing by waiting (a newcomer,
a spot notice), the agent asks its workers to checkpoint the step they are on and
exit. Waiting the whole --notice-deadline for workers that never look (a script
without a step boundary) stalled every resize by 25 s. So the agent waits only on
what the workers show it in their progress files (contract.py):

- no worker has a step boundary (`boundary` false or no progress at all): stop now;
- until the workers agree to stop (`stopping` set), wait a few of their own median
  step intervals (at least FLOOR_S): a worker past that has stopped stepping;
- once they agreed, rank 0 is writing the checkpoint: wait up to --notice-deadline.
Pure functions over the progress records; the agent does the waiting.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

NO_BOUNDARY, BY_PROGRESS, BY_DEADLINE = "no-boundary", "progress", "deadline"
# Step intervals to wait for the next boundary: one for the step in flight, one for
# the agreement's collective to meet every rank, and slack for a slow step.
INTERVALS = 4.0
# The shortest wait for an agreement: covers progress files written at most every
# 0.5 s and a fast step's scheduling jitter.
FLOOR_S = 1.0


@dataclass(frozen=True)
class DrainView:
    """What the progress files say right now."""

    boundary: bool  # some worker stops at a step boundary when asked
    stopping: bool  # some worker reported that the job agreed to stop
    step_interval_s: float | None  # median seconds per step over the ranks, if known


def view(records: list[dict]) -> DrainView:
    intervals = []
    for record in records:
        steps = record.get("step", 0) - record.get("prev_step", record.get("step", 0))
        span = record.get("time", 0.0) - record.get("prev_time", record.get("time", 0.0))
        if steps > 0 and span > 0:
            intervals.append(span / steps)
    return DrainView(boundary=any(r.get("boundary") for r in records),
                     stopping=any(r.get("stopping") is not None for r in records),
                     step_interval_s=statistics.median(intervals) if intervals else None)


def agreement_wait(state: DrainView, deadline_s: float) -> float:
    """Seconds to wait for the workers to agree to stop, from when they were asked."""
    derived = INTERVALS * state.step_interval_s if state.step_interval_s else 0.0
    return min(deadline_s, max(FLOOR_S, derived))


def decide(state: DrainView, waited_s: float, deadline_s: float) -> str | None:
    """How the drain ends now (NO_BOUNDARY / BY_DEADLINE), or None to keep waiting.

    BY_PROGRESS is the agent's to say: it sees the workers exit.
    """
    if not state.boundary:
        return NO_BOUNDARY
    if waited_s >= deadline_s:
        return BY_DEADLINE
    if not state.stopping and waited_s >= agreement_wait(state, deadline_s):
        return BY_DEADLINE
    return None
