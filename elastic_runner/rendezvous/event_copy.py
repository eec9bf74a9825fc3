"""The etcd copy of a run's events, for `elastic-run status` on any machine.

Why it is not every event of every node: at 1,024 nodes one in-place round's events
were three per node (reform_started, round_closed, resize), each under a lease of its
own, and round_closed carried the plan's whole member list (75 KB). Measured on this
machine (bench/event_copy_cost.py): 2.8-3.2 s of etcd CPU and 81 MB of etcd's space
per round, five to ten times the round's rendezvous, and etcd's default 2 GiB quota
full after about 25 rounds (then it refuses every write). So:

- a round's outcome (`JOB_WIDE`: the same on every member) is copied once, by the
  first member of that round's plan, without the member list (the plan key has it);
- what every node does every round (`LOCAL_ONLY`) stays in its own events.jsonl, and
  so does `joined`: one write per node at a start, which is the costliest round for
  etcd already; `status` reads when a node joined from its node key (registered_at);
- the rest (notices, failures, a node's end) under one lease per agent, taken at its
  first such event and renewed by a new grant after half its TTL, not one per event.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Callable

from elastic_runner.errors import LeaseNotFound
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.rendezvous import protocol as p

EVENT_TTL_S = 24 * 3600
JOB_WIDE = frozenset({"round_closed", "resize", "member_lost", "membership_changed"})
LOCAL_ONLY = frozenset({"joined", "workers_started", "reform_started", "drain",
                        "standby_ready"})
# Rounds whose first member is remembered (a loss names the round before the next).
_ROUNDS_KEPT = 4


class EventCopy:
    def __init__(self, client: EtcdClient, prefix: str, node_id: str,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self._client, self._prefix, self._node_id = client, prefix, node_id
        self._clock, self._wall_clock = clock, wall_clock
        self._lock = threading.Lock()  # guards _first_members: events come from several threads
        self._first_members: dict[int, str] = {}  # round -> its plan's first node
        self._lease: tuple[int, float] | None = None  # (id, when granted)

    def publish(self, record: dict) -> None:
        """Copy `record` to etcd if this node is the one to (module docstring). Called
        inline by EventLog.emit, also on the pause's path: a local-only event takes no
        lock, and no lock is held over a request to etcd."""
        kind, number = record.get("kind"), record.get("round")
        if kind in LOCAL_ONLY:
            return
        if kind in JOB_WIDE:
            with self._lock:
                if kind == "round_closed" and record.get("members"):
                    self._remember_first(number, record["members"][0]["node"])
                if self._first_members.get(number) != self._node_id:
                    return
            record = {k: v for k, v in record.items() if k != "members"}
        value = json.dumps(record, default=str).encode()
        key = p.event_key(self._prefix, int(self._wall_clock() * 1e9), self._node_id)
        try:
            self._client.put(key, value, lease=self._shared_lease())
        except LeaseNotFound:  # revoked or expired under us: once more, on a new one
            self._lease = None
            self._client.put(key, value, lease=self._shared_lease())

    def _remember_first(self, number: int, node: str) -> None:
        self._first_members[number] = node
        for old in [n for n in self._first_members if n <= number - _ROUNDS_KEPT]:
            del self._first_members[old]

    def _shared_lease(self) -> int:
        lease = self._lease
        if lease is None or self._clock() - lease[1] > EVENT_TTL_S / 2:
            # Two threads may both grant one here (rare): the spare expires unused.
            lease = self._lease = (self._client.grant_lease(EVENT_TTL_S), self._clock())
        return lease[0]
