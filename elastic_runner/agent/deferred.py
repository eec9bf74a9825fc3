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
  (or without the runtime at all): a change takes the restart path, as ever, unless
  this node's workers deferred before (same script): then it is on its way too.
The run is marked as re-forming in place at the first DEFERRED report (not at the
first step): newcomers then start their workers on standby before they join.
"""

from __future__ import annotations

import logging
from typing import Callable

from elastic_runner.agent.ports import Rendezvous
from elastic_runner.errors import RendezvousError
from elastic_runner.events import EventLog
from elastic_runner.reform import DEFERRED, STANDBY, STANDBY_ROUND, ReformChannel, WorkerState
from elastic_runner.rendezvous.protocol import Cause, Plan
from elastic_runner.rendezvous.ranks import assign_ranks, plan_problem

log = logging.getLogger("elastic_runner")

WAITING, READY = "waiting", "ready"  # for their place: on the way, or at the function


def waiting_for_place(states: dict[int, WorkerState], workers: int,
                      they_defer: bool = False) -> str | None:
    """WAITING or READY when every local worker is on its way to a place, else None.

    `they_defer`: this node's workers deferred their group before (the same script),
    so one not heard from yet is on its way too. Why it matters: on a busy machine the
    moment before a fresh worker's first report (Python, import torch) is the longest
    of its start (seen in a chaos soak: a change every few seconds restarted five
    nodes' booting workers over and over, 37 s before the first step)."""
    found = [states.get(local) for local in range(workers)]
    if not found or any(not _on_its_way(state, they_defer) for state in found):
        return None
    return READY if all(state is not None and state.phase == STANDBY
                        for state in found) else WAITING


class DeferredWorkers:
    """What one agent knows of its workers' deferred groups, from their reports."""

    def __init__(self, channel: ReformChannel, mark_run: Callable[[int], None]):
        self._channel, self._mark_run = channel, mark_run
        self._they_defer = False  # some worker of this node deferred its group, ever

    def waiting(self, workers: int, plan: Plan) -> str | None:
        """WAITING or READY (waiting_for_place); the run is then marked as re-forming
        in place, so that newcomers start their workers on standby."""
        states = self._channel.states()
        self._they_defer = self._they_defer or any(
            state.phase == DEFERRED for state in states.values())
        waiting = waiting_for_place(states, workers, self._they_defer)
        if waiting is not None:
            self._mark_run(plan.round)
        return waiting


def _on_its_way(state: WorkerState | None, they_defer: bool) -> bool:
    if state is None:
        return they_defer
    return state.round == STANDBY_ROUND and state.phase in (DEFERRED, STANDBY)


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
