"""Who gets which rank: the closing agent orders a round's joiners and writes the
plan; every agent checks the plan and derives its workers' ranks from it.

Pure functions over protocol.py's values; this module imports only protocol.py,
and lives apart from its round rules only to keep each a size one can read through.
Nothing here reads a clock or does I/O: the same joiners give the same order on
any agent, every agent derives its workers' ranks from the one written plan the
same way, and a test checks each rule without etcd.

Why the order is what it is:
- Rank order is stable: members of the previous plan keep their relative order,
  newcomers follow in the order they joined (etcd create revision, never a
  time: clocks of different machines are not compared, protocol.py says why).
- Nodes are grouped by zone, then rack (GROUP_KEYS), into contiguous rank
  blocks, each group placed where its first node appears: a newcomer lands inside
  its zone's block, and survivors keep their order wherever the grouping allows.
- A node matching --rank0-prefer goes first (its zone and rack with it): rank 0
  writes checkpoints and hosts the store, so it belongs on the steadiest node.
- Node ranks are contiguous from 0 and each node's workers hold one block of
  global ranks; a plan that breaks this (`plan_problem`) could give two workers
  one rank, so no worker starts on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_runner.rendezvous.protocol import Joiner, Member, Plan

# Labels that group nodes into contiguous rank blocks, outermost first.
GROUP_KEYS = ("zone", "rack")


def rank_order(previous: tuple[str, ...], joiners: list[Joiner],
               prefer: tuple[str, str] | None = None) -> list[Joiner]:
    """Stable order, then grouped by zone and rack, rank 0 on a preferred node.

    Survivors keep their relative order and newcomers follow by join revision;
    grouping then pulls each zone (and each rack inside it) into one contiguous
    block, in the order its first node appears, so a newcomer lands inside its
    zone's block and survivors keep their order wherever the grouping allows.
    If a node matches `prefer` (key, value), it goes first (and its zone and
    rack with it): rank 0 writes checkpoints and hosts the store, so it belongs
    on the steadiest node.
    """
    position = {node_id: index for index, node_id in enumerate(previous)}
    survivors = sorted((j for j in joiners if j.node_id in position),
                       key=lambda j: position[j.node_id])
    newcomers = sorted((j for j in joiners if j.node_id not in position),
                       key=lambda j: (j.join_revision, j.node_id))
    base = survivors + newcomers
    if prefer is not None:
        preferred = next((j for j in base if j.label(prefer[0]) == prefer[1]), None)
        if preferred is not None:
            base = [preferred] + [j for j in base if j is not preferred]
    return _group(base, 0)


def _group(nodes: list[Joiner], depth: int) -> list[Joiner]:
    if depth == len(GROUP_KEYS):
        return nodes
    buckets: dict[str, list[Joiner]] = {}
    for node in nodes:
        buckets.setdefault(node.label(GROUP_KEYS[depth]), []).append(node)
    return [node for bucket in buckets.values() for node in _group(bucket, depth + 1)]


def build_plan(number: int, ordered: list[Joiner], max_nodes: int, restart_count: int,
               cause: str, max_workers: int = 0) -> Plan:
    """Take joiners in order up to max_nodes (and max_workers, skipping nodes that
    would overshoot it); node ranks contiguous, global ranks in per-node blocks."""
    chosen: list[Joiner] = []
    workers = 0
    for joiner in ordered:
        if len(chosen) < max_nodes and (not max_workers or workers + joiner.nproc <= max_workers):
            chosen.append(joiner)
            workers += joiner.nproc
    members, first_rank = [], 0
    for node_rank, joiner in enumerate(chosen):
        members.append(Member(joiner.node_id, node_rank, joiner.nproc, joiner.addr, first_rank,
                              joiner.labels))
        first_rank += joiner.nproc
    host = chosen[0]
    return Plan(number, tuple(members), host.addr, host.port, restart_count, cause)


def plan_problem(plan: Plan) -> str | None:
    """Why workers must not start on this plan (None when it is sound)."""
    if not plan.members:
        return "the plan has no members"
    ranks = [r for m in plan.members for r in range(m.first_rank, m.first_rank + m.nproc)]
    if sorted(ranks) != list(range(plan.world_size)):
        return f"global ranks {sorted(ranks)} are not exactly 0..{plan.world_size - 1}"
    if [m.node_rank for m in plan.members] != list(range(len(plan.members))):
        return "node ranks are not contiguous from 0"
    return None


@dataclass(frozen=True)
class RankAssignment:
    """The torchrun environment of one worker, derived from a plan."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    group_world_size: int


def assign_ranks(plan: Plan, node_id: str) -> list[RankAssignment]:
    member = plan.member(node_id)
    if member is None:
        return []
    return [
        RankAssignment(member.first_rank + local, local, plan.world_size, member.nproc,
                       member.node_rank, len(plan.members))
        for local in range(member.nproc)
    ]
