"""Admitting newcomers: who waits outside the plan, and when a round opens for them.

Every time here is this agent's own monotonic clock: when its copy of etcd first
saw a node key (PrefixMirror.first_seen). Timestamps written by other machines
are never compared with it (protocol.py says why).

Two agents open the round for a newcomer. The opener (the plan's member ranked
first among the deputies, deputies.py, which copy every node key) has watched
the job for a while, so it saw every newcomer register and can tell a lone
arrival (open at once) from a burst (wait for quiet). The newcomer itself is the
backup: it cannot know how old the keys it found when it started are, so it
counts them as just seen and waits up to the settle time; a newcomer that is no
deputy sees no other node key and waits --settle-max. Opening is a
compare-and-swap on the round key, so when both try, one round opens. Only one
member tries, so a thousand members do not send a thousand transactions.

A member that a round closed for a suspicion left out (decisions.py:
`left_out_on_suspicion`) is no newcomer to the first member: its key may only
be waiting for its lease to expire, and a round opened for it would wait for
it until then. If it is alive it opens the round itself (the backup rule).
"""

from __future__ import annotations

import json
import math
from typing import Callable

from elastic_runner.config import RendezvousConfig
from elastic_runner.etcd.mirror import PrefixMirror
from elastic_runner.rendezvous import decisions as d
from elastic_runner.rendezvous import protocol as p


class LeftOut:
    """Nodes a round left out on suspicion, each remembered by its key's incarnation
    (create revision) until that key goes or a later plan takes the node back.

    Why remembered: a SIGKILLed node's key lives on until its lease expires (the
    lease TTL), and a round opened meanwhile for any other reason (a join, a notice)
    would count it as a live node yet to join and wait for it. Every member of the
    plan that left it out notes it, so whichever closes a later round knows.
    """

    def __init__(self, mirror: PrefixMirror, config: RendezvousConfig):
        self._mirror = mirror
        self._prefix = config.prefix
        self._left: dict[str, int] = {}
        self._noted_round = -1

    def note(self, plan: p.Plan, previous: p.Plan | None) -> None:
        """`plan` was closed: remember whom it left out, forget whom it took back."""
        if plan.round <= self._noted_round:
            return
        self._noted_round = plan.round
        for node in plan.node_ids:
            self._left.pop(node, None)
        for node in d.left_out_on_suspicion(plan, previous):
            kv = self._mirror.get(p.node_key(self._prefix, node))
            if kv is not None:
                self._left[node] = kv.create_revision

    def live(self) -> frozenset[str]:
        """Those whose key is still the one that was left out."""
        for node, revision in list(self._left.items()):
            kv = self._mirror.get(p.node_key(self._prefix, node))
            if kv is None or kv.create_revision != revision:
                del self._left[node]  # gone, or back as a new agent: a newcomer
        return frozenset(self._left)


class Newcomers:
    def __init__(self, mirror: PrefixMirror, config: RendezvousConfig,
                 clock: Callable[[], float], opener: Callable[[p.Plan], str | None]):
        self._mirror = mirror
        # Which member of a plan admits newcomers (the deputy ranked first in it).
        self._opener = opener
        self._config = config
        self._clock = clock
        self._nodes = p.nodes_prefix(config.prefix)
        self.left_out = LeftOut(mirror, config)
        # ((round, live nodes, departures), when to look again): the first member
        # is asked every monitor tick, and a scan of every node key each time
        # would cost O(N) per tick where nothing changed.
        self._checked: tuple[tuple[int, int, int], float] | None = None

    def registered(self) -> dict[str, float]:
        """Live nodes and when this agent first saw each one's node key."""
        return {p.node_id_from_key(key): seen
                for key, seen in self._mirror.first_seen_in(self._nodes).items()}

    def has_room(self, plan: p.Plan, nproc: int) -> bool:
        """Could a node of `nproc` workers join `plan` within --max-nodes/--max-workers?"""
        return d.has_room(plan, nproc, self._config.max_nodes, self._config.max_workers)

    def own_wait(self, registered_at: float) -> float:
        """Seconds this node, outside a closed plan with room, waits before opening a round.

        `registered_at`: when this node registered, on our clock.
        """
        now = self._clock()
        if not self._mirror.wide:  # no other node key in our copy: the opener decides
            return max(0.0, registered_at + self._config.settle_max_s - now)
        registered = self.registered()
        own = registered.pop(self._config.node_id, now)
        return d.newcomer_wait(now, own, list(registered.values()), self._config.settle_s,
                               self._config.settle_max_s)

    def members_wait(self, plan: p.Plan) -> float | None:
        """For the plan's opener: seconds before it opens a round for newcomers.

        None when this node is not the opener or no live node outside the plan
        would fit into it (a standby node of a full run waits for a departure).
        """
        if not plan.members or self._opener(plan) != self._config.node_id:
            return None
        now = self._clock()
        census = (plan.round, *self._mirror.census(self._nodes))
        if self._checked is not None and self._checked[0] == census and now < self._checked[1]:
            return self._checked[1] - now if math.isfinite(self._checked[1]) else None
        registered = self.registered()
        waiting = self._waiting(plan)
        wait = d.members_open_wait(now, registered, waiting, self._config.settle_s,
                                   self._config.settle_max_s)
        self._checked = (census, math.inf if wait is None else now + wait)
        return wait

    def _waiting(self, plan: p.Plan) -> list[str]:
        """Live nodes outside `plan` that would fit into it (not those it left out
        on a suspicion)."""
        in_plan = set(plan.node_ids) | d.left_out_on_suspicion(plan, self._previous(plan)) \
            | self.left_out.live()
        waiting = []
        for kv in self._mirror.children(self._nodes):
            node = p.node_id_from_key(kv.key)
            if node not in in_plan and self.has_room(plan, _nproc(kv.value)):
                waiting.append(node)
        return waiting

    def _previous(self, plan: p.Plan) -> p.Plan | None:
        """The plan before `plan`, as our copy of etcd holds it (whole while `plan` is
        one of the newest two: protocol.PLANS_KEPT)."""
        if plan.round == 0:
            return None
        kv = self._mirror.get(p.plan_key(self._config.prefix, plan.round - 1))
        return p.plan_from(kv.value) if kv else None


def _nproc(raw: bytes) -> int:
    """A node record's worker count (1 for a record that does not say)."""
    try:
        return int(json.loads(raw).get("nproc", 1))
    except (ValueError, TypeError, AttributeError):
        return 1
