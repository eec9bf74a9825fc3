"""An agent while etcd does not answer: its workers train on through a short
outage, stop past the grace, and the agent waits (bounded) for etcd to come back.

Why stop at all: without etcd nobody can see a member leave, and a worker failure
could not be recorded; a clean stop keeps the checkpoint.

A full etcd (its NOSPACE alarm: EtcdFull) is an outage of writes only. Keep-alives
and reads go on, so workers train on until something must be written (a round, a
failure, a checkpoint record); then the agent waits the same way, asking with a
write, until an operator frees space and disarms the alarm. Before, every agent
ended with exit 4 at its first refused write, and the job had to be started again.
"""

from __future__ import annotations

import logging
import threading

from tenacity import (
    Retrying, retry_if_exception_type, stop_after_delay, stop_when_event_set, wait_fixed,
)

from elastic_runner.agent.ports import Rendezvous
from elastic_runner.errors import EtcdFull, EtcdUnavailable, ShutdownRequested
from elastic_runner.events import EventLog

log = logging.getLogger("elastic_runner")

# Seconds between pings while the workers are stopped for an etcd outage; between
# write probes while etcd is full (an operator's fix takes minutes, and each refused
# probe is one more request to an etcd that serves every agent of the fleet).
ETCD_RETRY_S = 0.5
FULL_RETRY_S = 2.0


def check_grace(rendezvous: Rendezvous, grace_s: float) -> None:
    """Raise EtcdUnavailable once etcd has been silent past `grace_s`.

    Why one more question before that: the silence is measured from the last
    keep-alive answer, so a host frozen past the grace (SIGSTOP, swapping) wakes
    to a stale figure before its keep-alive thread has asked again. Seen in a
    chaos soak: a node thawed after 7 s stopped its in-place workers for "no
    answer from etcd for 7 s" though etcd answered at once, and the others then
    waited 6 s for fresh workers to boot; kept, they rejoin the next round.
    """
    silent = rendezvous.seconds_since_etcd_answered()
    if silent > grace_s and not rendezvous.etcd_answers_now():
        raise EtcdUnavailable(f"no answer from etcd for {silent:.0f} s (grace {grace_s:.0f} s)")


def wait_for_etcd(rendezvous: Rendezvous, events: EventLog, signal_seen: threading.Event,
                  join_timeout_s: float, error: EtcdUnavailable) -> None:
    """Workers are stopped; wait (up to --join-timeout) for etcd to answer again.

    A bounded retry, one ping per ETCD_RETRY_S (for a full etcd, one write probe per
    FULL_RETRY_S: it answers pings while it refuses writes): past --join-timeout the
    last EtcdUnavailable ends the node; a signal ends the wait at once as
    ShutdownRequested (the pause between pings wakes on it, so no ping is wasted).
    """
    full = isinstance(error, EtcdFull)
    log.warning("%s; workers stopped, waiting up to %.0f s for etcd%s", error, join_timeout_s,
                " to accept writes" if full else "")
    events.emit("etcd_lost", error=str(error))
    retrying = Retrying(
        retry=retry_if_exception_type(EtcdUnavailable),
        wait=wait_fixed(FULL_RETRY_S if full else ETCD_RETRY_S),
        stop=stop_after_delay(join_timeout_s) | stop_when_event_set(signal_seen),
        sleep=signal_seen.wait, reraise=True)
    try:
        for attempt in retrying:
            with attempt:
                if signal_seen.is_set():
                    raise ShutdownRequested("shutdown requested while etcd was unreachable")
                rendezvous.ping(write=full)
    except EtcdUnavailable:
        if signal_seen.is_set():
            raise ShutdownRequested("shutdown requested while etcd was unreachable") from None
        raise
    log.info("etcd answers again: re-forming the job")
