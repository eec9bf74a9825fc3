"""Rendezvous deputies: the few agents that watch every key of a run.

Why: when every agent copied the whole run prefix, each of a round's N join
writes (and each of N registrations) reached N copies: N^2 watch events per
round, a million at 1,024 nodes, which was most of etcd's CPU and the agents'.
Only the agents that decide something from the join and node keys need them:
the one that closes a round (and its backups), the ones that see a member lost
and the one that admits newcomers. Those are at most `count` deputies, each
holding a slot key under its lease; every other agent copies only the shared
range (protocol.shared_range: notices, the round key, the slots), so a round
costs it O(1) events whatever N is, and etcd's work per round is O(N).

A slot frees when its holder's lease ends (a crash, a leave, a lost lease).
Agents see the slot key go (it is in their range) and race to take it with a
create-if-absent, so a lost deputy is replaced within one round trip; the race
costs at most one transaction per agent per freed slot. With `count` agents or
fewer every agent is a deputy, which is how every run of a few nodes behaves.
"""

from __future__ import annotations

import zlib
from typing import Callable

from elastic_runner.errors import LeaseNotFound
from elastic_runner.etcd.client import EtcdClient, Nested, Put, key_missing
from elastic_runner.etcd.mirror import PrefixMirror
from elastic_runner.rendezvous import protocol as p


# Slots offered inside the registration transaction, one nested in the other's
# failure branch (etcd's request nesting is bounded); any further slot is taken
# by ensure().
SLOTS_AT_REGISTRATION = 8


class Deputies:
    def __init__(self, client: EtcdClient, mirror: PrefixMirror, prefix: str, node_id: str,
                 count: int, write_visible_timeout_s: float,
                 lease_gone: Callable[[str], None]):
        self._client = client
        self._mirror = mirror
        self._slots = p.deputy_prefix(prefix)
        self._node_id = node_id
        self._count = count
        self._visible_timeout_s = write_visible_timeout_s
        # etcd refused a slot under our lease: the owner registers again (a starved
        # agent's lease can expire before its keep-alive thread hears of it).
        self._lease_gone = lease_gone
        # Answers kept while the slots' census is unchanged (slot keys are created
        # once and never overwritten, so any change moves the census): the monitor
        # loop of every agent asks each tick.
        self._holders: tuple[tuple[int, int], dict[str, int]] | None = None
        self._answer: tuple[tuple[int, int], int, bool] | None = None

    def holders(self) -> dict[str, int]:
        """Deputies now: node id -> lease of its slot key."""
        census = self._mirror.census(self._slots)  # before the keys: never newer than them
        if self._holders is None or self._holders[0] != census:
            self._holders = (census, {kv.value.decode(): kv.lease
                                      for kv in self._mirror.children(self._slots)})
        return self._holders[1]

    def holds(self, lease_id: int) -> bool:
        """Whether this agent holds a slot under `lease_id` (its current lease)."""
        return self.holders().get(self._node_id) == lease_id

    def claim_ops(self, lease_id: int) -> tuple[Nested, ...]:
        """Take the first free slot, as part of the registration transaction.

        Why there: a thousand agents registering at once all saw the slots free
        in their copies (the first deputies' writes had not reached them yet)
        and 7 in 10 sent a slot transaction that failed. Inside the registration
        transaction the slots are looked at in etcd's order of registrations:
        the first `count` agents take them, and the others' copies, read in the
        same transaction, show them taken.
        """
        chain: tuple[Nested, ...] = ()
        for slot in reversed(range(min(self._count, SLOTS_AT_REGISTRATION))):
            key = f"{self._slots}{slot}"
            chain = (Nested((key_missing(key),), (Put(key, self._node_id.encode(), lease_id),),
                            chain),)
        return chain

    def ensure(self, lease_id: int) -> bool:
        """Take a free slot if there is one; True when this agent is a deputy.

        Cheap when nothing changed (the monitor loop asks every tick): the answer
        holds, and a failed attempt is not repeated, until the slots or our lease
        change.
        """
        census = self._mirror.census(self._slots)
        if self._answer is not None and self._answer[:2] == (census, lease_id):
            return self._answer[2]
        self._answer = (census, lease_id, self._ensure(lease_id))
        return self._answer[2]

    def _ensure(self, lease_id: int) -> bool:
        if self.holds(lease_id):
            self._mirror.widen()
            return True
        taken = {p.node_id_from_key(kv.key) for kv in self._mirror.children(self._slots)}
        free = [slot for slot in range(self._count) if str(slot) not in taken]
        if not free:
            return False
        # Spread the agents that saw the same free slots over them, so one wave of
        # attempts fills them all.
        slot = free[zlib.crc32(self._node_id.encode()) % len(free)]
        key = f"{self._slots}{slot}"
        try:
            result = self._client.txn([key_missing(key)],
                                      [Put(key, self._node_id.encode(), lease_id)])
        except LeaseNotFound as exc:
            self._lease_gone(f"etcd refused our deputy slot ({exc})")
            return False
        if not result.succeeded:
            return False
        if self._mirror.wide:
            self._mirror.wait_revision(result.revision, timeout_s=self._visible_timeout_s)
        else:
            self._mirror.widen()  # its read is at or after our write
        return self.holds(lease_id)

    def opener(self, plan: p.Plan) -> str | None:
        """The member that admits newcomers into `plan`: the deputy ranked first in it."""
        deputies = self.holders()
        return next((node for node in plan.node_ids if node in deputies), None)
