"""Member workers that take their place late: `er.init(defer_group=True)` (issue 15).

Why: a worker's first process group used to form in `er.init()`, from the round its
agent started it in. A node that joined or left while the workers were still
importing torch, building the model and restoring then made that round obsolete, and
the only way on was the restart path: stop every worker, start new ones (seen in
spot replays: the trace's first seconds, nodes coming and going faster than a worker
boots, cost 11.8 s without a step). A script that trains under `@er.elastic` can
instead leave its group to the training function, which takes its place from the
agent like a newcomer's standby worker (agent/standby.py) does.

What the agent sees, from the re-formation channel (reform.py), and does:
- every local worker reported DEFERRED (in `er.init()`) or STANDBY (at its training
  function) for STANDBY_ROUND: they hold no group, so any change of membership is
  *followed*: the agent joins the next round at once and its workers never notice.
  A newcomer too: a member whose workers already took their place is forming the
  old round, and calls it off for the newcomer (InProcessReform.place, `deferred`),
  so every member moves on instead of one waiting out its formation timeout;
- every local worker reported STANDBY: the agent gives them their places in the
  round current now (`InProcessReform.place`), and from their first TRAINING report
  on they re-form in place like any other;
- a worker that has not reported yet may belong to a script without `defer_group`
  (or without the runtime at all): a change takes the restart path, as ever.
The run is marked as re-forming in place at the first DEFERRED report (not at the
first step): newcomers then start their workers on standby before they join.
"""

from __future__ import annotations

import logging

from elastic_runner.agent.ports import Rendezvous
from elastic_runner.events import EventLog
from elastic_runner.reform import DEFERRED, STANDBY, STANDBY_ROUND, WorkerState
from elastic_runner.rendezvous.protocol import Cause, Plan
from elastic_runner.rendezvous.ranks import assign_ranks, plan_problem
from elastic_runner.errors import RendezvousError

log = logging.getLogger("elastic_runner")

WAITING, READY = "waiting", "ready"  # for their place: on the way, or at the function


def waiting_for_place(states: dict[int, WorkerState], workers: int) -> str | None:
    """WAITING or READY when every local worker is on its way to a place, else None."""
    found = [states.get(local) for local in range(workers)]
    if not found or any(state is None or state.round != STANDBY_ROUND
                        or state.phase not in (DEFERRED, STANDBY) for state in found):
        return None
    return READY if all(state.phase == STANDBY for state in found) else WAITING


def follow(rendezvous: Rendezvous, events: EventLog, node_id: str, plan: Plan,
           cause: Cause) -> Plan | None:
    """Join the round after `plan` while the workers have no group; the new plan, or
    None when this node is not in it (then its workers are to be stopped)."""
    new = rendezvous.next_plan(plan, cause)
    problem = plan_problem(new)
    if problem:
        raise RendezvousError(f"refusing to place workers in round {new.round}: {problem}")
    if not assign_ranks(new, node_id):
        log.info("this node is not in round %d: stopping its workers before they took "
                 "a place", new.round)
        return None
    events.emit("round_closed", **new.event_fields(), inprocess=True, deferred=True)
    log.info("round %d closed while the workers get ready (%s; world size %d -> %d): they "
             "take their places in it, no restart", new.round, cause.text(),
             plan.world_size, new.world_size)
    return new
