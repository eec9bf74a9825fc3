"""Issue 8: mixed node sizes, zone-contiguous ranks, rank 0 on the on-demand node."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.socket_probe]  # about the agents, not torch


def blocks(rows: list[dict]) -> dict[str, list[int]]:
    """Global ranks seen per node (by the agent's node id in the plan line)."""
    found: dict[str, set[int]] = {}
    for row in rows:
        found.setdefault(row["GROUP_RANK"], set()).add(int(row["RANK"]))
    return {group: sorted(ranks) for group, ranks in found.items()}


def plan_order(job, node: str, round_id: str) -> list[str]:
    """Node ids in rank order from the agent's printed plan for a round."""
    line = next(l for l in job.agent_log(node).splitlines() if f"round {round_id}:" in l)
    inner = line.split("[", 2)[2].split("]")[0]
    return [part.split("=ranks")[0].split("(")[0].strip() for part in inner.split(", ")]


def test_nodes_with_one_two_and_three_workers(job):
    job.start("one", nproc_per_node=1)
    job.start("two", nproc_per_node=2)
    job.start("three", nproc_per_node=3)
    rows = job.wait_world(6, timeout=60)
    assert {int(r["RANK"]) for r in rows} == set(range(6))
    for ranks in blocks(rows).values():
        assert ranks == list(range(ranks[0], ranks[0] + len(ranks)))  # contiguous block
    sizes = sorted({(r["GROUP_RANK"], r["LOCAL_WORLD_SIZE"]) for r in rows})
    assert sorted(int(size) for _, size in sizes) == [1, 2, 3]
    for row in rows:
        first = min(blocks(rows)[row["GROUP_RANK"]])
        assert int(row["LOCAL_RANK"]) == int(row["RANK"]) - first
    killed_at = time.time()
    job.kill("two")
    rows = job.wait_world(4, after=killed_at, timeout=60)
    assert {int(r["RANK"]) for r in rows} == set(range(4))
    assert sorted(len(r) for r in blocks(rows).values()) == [1, 3]


def test_zones_get_contiguous_ranks_and_an_on_demand_newcomer_takes_rank0_with_its_zone(job):
    """Four spot nodes in zones a, b, a, b: each zone gets one contiguous block of ranks.
    Then a3 joins, on-demand, in zone a: rank 0 moves to it (it was on a spot node), and
    its zone comes first with it, still contiguous: a3, a1, a2, b1, b2."""
    job.nproc, job.settle, job.max_nodes = 1, 3.0, 5
    for name, zone in (("a1", "a"), ("b1", "b"), ("a2", "a"), ("b2", "b")):
        job.start(name, node_label=[f"zone={zone}", "lifecycle=spot"])
        # A known join order (zones interleaved a, b, a, b): the next node starts only
        # once this one is registered in etcd.
        job.wait_for(lambda: name in job.node_keys(), 60, f"{name} registered")
    rows = job.wait_world(4, timeout=60)
    order = plan_order(job, "a1", rows[0]["ELASTIC_RUN_ROUND"])
    zones = [name[0] for name in order]
    assert zones in (["a", "a", "b", "b"], ["b", "b", "a", "a"]), order
    joined_at = time.time()
    job.start("a3", node_label=["zone=a", "lifecycle=on-demand"])
    rows = job.wait_world(5, after=joined_at, timeout=60)
    order = plan_order(job, "a1", rows[0]["ELASTIC_RUN_ROUND"])
    assert order[0] == "a3", f"rank 0 not on the on-demand node: {order}"
    assert [name[0] for name in order] == ["a", "a", "a", "b", "b"], order
