"""Topology rules of the rank order: zone/rack blocks, rank 0 preference, worker caps."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.ranks import build_plan, plan_problem, rank_order


def node(name: str, revision: int, zone: str = "", rack: str = "", lifecycle: str = "",
         nproc: int = 1) -> p.Joiner:
    labels = tuple(sorted((k, v) for k, v in (("zone", zone), ("rack", rack),
                                              ("lifecycle", lifecycle)) if v))
    return p.Joiner(name, f"h-{name}", 1000 + revision, nproc, revision, labels)


def blocks_contiguous(order: list[p.Joiner], key) -> bool:
    seen, last = set(), object()
    for item in order:
        value = key(item)
        if value != last and value in seen:
            return False
        seen.add(value)
        last = value
    return True


def test_zones_a_b_a_b_become_two_blocks_in_first_appearance_order():
    joiners = [node("n1", 1, "a"), node("n2", 2, "b"), node("n3", 3, "a"), node("n4", 4, "b")]
    assert [j.node_id for j in rank_order((), joiners)] == ["n1", "n3", "n2", "n4"]


def test_a_zone_newcomer_joins_its_zone_block():
    previous = ("n1", "n3", "n2", "n4")
    joiners = [node("n1", 1, "a"), node("n2", 2, "b"), node("n3", 3, "a"), node("n4", 4, "b"),
               node("n5", 9, "a")]
    assert [j.node_id for j in rank_order(previous, joiners)] == ["n1", "n3", "n5", "n2", "n4"]


def test_rank0_goes_to_the_on_demand_node_with_its_zone():
    joiners = [node("s1", 1, "a", lifecycle="spot"), node("s2", 2, "b", lifecycle="spot"),
               node("od", 3, "b", lifecycle="on-demand")]
    order = rank_order(("s1", "s2"), joiners, prefer=("lifecycle", "on-demand"))
    assert [j.node_id for j in order] == ["od", "s2", "s1"]
    assert [j.node_id for j in rank_order(("s1", "s2"), joiners)] == ["s1", "s2", "od"]


def test_max_workers_skips_a_node_that_would_overshoot():
    joiners = [node("big", 1, nproc=4), node("mid", 2, nproc=3), node("small", 3, nproc=1)]
    plan = build_plan(0, joiners, max_nodes=8, restart_count=0, cause="start", max_workers=5)
    assert plan.node_ids == ("big", "small") and plan.world_size == 5
    assert plan_problem(plan) is None


def test_plan_problem_names_a_rank_gap():
    plan = p.Plan(0, (p.Member("a", 0, 2, "h", 0), p.Member("b", 1, 2, "h", 3)), "h", 1)
    assert "not exactly 0..3" in plan_problem(plan)


labelled = st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from("xy"), st.booleans(),
                              st.integers(1, 4)), min_size=1, max_size=10)


@settings(max_examples=200, deadline=None)
@given(labelled, st.integers(0, 10), st.booleans())
def test_order_properties(specs, survivors, prefer):
    joiners = [node(f"n{i}", i, zone, rack, "on-demand" if od else "spot", nproc)
               for i, (zone, rack, od, nproc) in enumerate(specs)]
    previous = tuple(j.node_id for j in reversed(joiners[:survivors]))
    order = rank_order(previous, joiners, ("lifecycle", "on-demand") if prefer else None)
    assert sorted(j.node_id for j in order) == sorted(j.node_id for j in joiners)
    assert blocks_contiguous(order, lambda j: j.label("zone"))
    assert blocks_contiguous(order, lambda j: (j.label("zone"), j.label("rack")))
    if prefer and any(j.label("lifecycle") == "on-demand" for j in joiners):
        assert order[0].label("lifecycle") == "on-demand"
    # Within one (zone, rack) group, survivors keep their previous relative order.
    position = {n: i for i, n in enumerate(previous)}
    for group in {(j.label("zone"), j.label("rack")) for j in joiners}:
        kept = [j.node_id for j in order if j.node_id in position
                and (j.label("zone"), j.label("rack")) == group
                and not (prefer and j is order[0])]
        assert kept == sorted(kept, key=position.get)
    plan = build_plan(0, order, len(order), 0, "start")
    assert plan_problem(plan) is None
