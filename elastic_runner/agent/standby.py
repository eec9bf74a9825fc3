"""A joining node's workers start before the node announces itself (issue 15, a join).

Why: on a join the others pause until the newcomer's workers are in the new process
group. A fresh worker must first start Python, import torch, build its model and
restore a checkpoint: seconds on a CPU, tens of seconds on a GPU node (CUDA and the
checkpoint read). When the run's workers re-form in place (an agent saw them do it
and marked the run in etcd: protocol.inplace_key), a new node's agent starts its workers on
standby instead: no rank, no process group, the re-formation channel's folder. Each
runs the script up to its training function and reports STANDBY (reform.py); only
then does the node register, so the round for it opens when its workers are ready.
When that round closes, the agent writes their places exactly as a re-formation does
(`InProcessReform.place`), and the others pause only for the new process group and
the state transfer.

What can go wrong: a worker exits or reports FAILED on standby, or they are not all
ready within --join-timeout (the patience a joining node has anyway). Then the
standby workers are stopped and the node joins as it always did, starting fresh
workers once its round closes: one line and one `standby_fallback` event. A signal
ends the wait at once.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from elastic_runner.agent.ports import Rendezvous, Workers
from elastic_runner.errors import ShutdownRequested
from elastic_runner.events import EventLog
from elastic_runner.reform import FAILED, STANDBY, STANDBY_ROUND, ReformChannel

log = logging.getLogger("elastic_runner")

POLL_S = 0.05  # nobody waits on this one: the node has not joined yet


class WarmStart:
    """One agent's standby workers, from their start until its first round."""

    def __init__(self, rendezvous: Rendezvous, channel: ReformChannel, events: EventLog,
                 start_standby: Callable[[], Workers], ready_s: float, stop_grace_s: float,
                 stop_requested: Callable[[], bool]):
        self._rendezvous = rendezvous
        self._channel = channel
        self._events = events
        self._start_standby = start_standby
        self._ready_s = ready_s
        self._stop_grace_s = stop_grace_s
        self._stop_requested = stop_requested

    def join(self) -> Workers | None:
        """Announce this node; where the run's workers re-form in place, after starting
        them on standby. Returns those workers once ready, or None (the run does not
        re-form in place, or they could not get ready: then they are stopped).
        Raises ShutdownRequested, the node not announced, when a signal came first.

        The first registration asks in the same request whether the run re-forms in
        place (rendezvous.register: `unless_in_place`); only then are workers started
        and the node announced by a second one.
        """
        if self._rendezvous.register(unless_in_place=True):
            return None
        group = None if self._stop_requested() else self._ready_workers()
        try:
            if self._stop_requested():  # reclaimed while its workers got ready: announcing
                # the node now would only cost the others a round for it
                raise ShutdownRequested("a signal arrived before the node joined the run")
            self._rendezvous.register()
        except BaseException:  # a signal, a duplicate node id, etcd gone: no workers left
            if group is not None:
                group.stop(self._stop_grace_s)
            raise
        return group

    def _ready_workers(self) -> Workers | None:
        started = time.monotonic()
        group = self._start_standby()
        log.info("the run's workers re-form in place: starting %d worker(s) on standby "
                 "before joining", len(group.pids))
        problem = self._wait_ready(group, started + self._ready_s)
        if problem is None:
            waited = time.monotonic() - started
            log.info("standby workers ready after %.2f s; joining the run", waited)
            self._events.emit("standby_ready", pids=group.pids, waited_s=round(waited, 3))
            return group
        group.stop(self._stop_grace_s)
        if not self._stop_requested():
            log.warning("standby workers not ready (%s); joining with fresh workers instead",
                        problem)
            self._events.emit("standby_fallback", round=STANDBY_ROUND, reason=problem)
        return None

    def _wait_ready(self, group: Workers, deadline: float) -> str | None:
        """None once every worker reported STANDBY, else why not."""
        while not self._stop_requested():
            states = self._channel.states()
            for local, exit in enumerate(group.poll()):
                state = states.get(local)
                if state is not None and state.phase == FAILED:
                    return f"local rank {local} failed: {state.reason or 'no reason given'}"
                if exit is not None:
                    return f"local rank {local} exited with code {exit.exit_code}"
            ready = [local for local in range(len(group.pids))
                     if (state := states.get(local)) is not None and state.phase == STANDBY]
            if len(ready) == len(group.pids):
                return None
            if time.monotonic() >= deadline:
                waiting = sorted(set(range(len(group.pids))) - set(ready))
                return (f"local rank(s) {', '.join(map(str, waiting))} not ready within "
                        f"{self._ready_s:g} s")
            time.sleep(POLL_S)
        return "a signal arrived"
