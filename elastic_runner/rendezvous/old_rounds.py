"""What closing a round makes obsolete, written in the closing transaction.

Why: every round leaves keys behind (its plan; with the torchrun plug-in, torch's
store). A plan is 8-21 KB at 1,024 members and a spot fleet closes a round every few
minutes, so in a week etcd held hundreds of MB of plans nobody reads, every deputy
kept them in its copy, and every resync (a new deputy, a compaction) read them all.

Kept: the newest closed round's plan and the one before it (a round is decided
against its previous plan). Older plan keys are overwritten with
protocol.SUPERSEDED_PLAN rather than deleted, because a checkpoint writer of round r
is fenced by the existence of round r+1's plan key (worker/checkpoint/etcd_store.py);
deleting it would let a writer that slept through two rounds publish again.
"""

from __future__ import annotations

from elastic_runner.etcd.values import Delete, Put
from elastic_runner.rendezvous import protocol as p


def superseded_by(prefix: str, number: int) -> list[Put | Delete]:
    """Round `number` closes: the plan PLANS_KEPT rounds behind loses its bytes, and
    that round's torch store goes (torch reads a round's store only while it forms)."""
    old = number - p.PLANS_KEPT
    if old < 0:
        return []
    return [Put(p.plan_key(prefix, old), p.SUPERSEDED_PLAN),
            Delete(p.store_prefix(prefix, old), prefix=True)]
