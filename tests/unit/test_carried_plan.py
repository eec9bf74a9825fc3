"""The plan a closed round key carries: an edit of the previous plan, rebuilt exactly
by a member that holds that plan, and the whole plan where no edit is shorter (no I/O)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_runner.rendezvous import carried_plan as cp
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.ranks import build_plan, rank_order

PROPS = settings(max_examples=300, deadline=None)


def joiner(name: str, revision: int, nproc: int = 8, addr: str = "", labels=()) -> p.Joiner:
    return p.Joiner(name, addr or f"10.0.{revision // 250}.{revision % 250}", 29500, nproc,
                    revision, tuple(sorted(labels)))


def plan_of(number: int, joiners, previous: p.Plan | None = None) -> p.Plan:
    order = rank_order(previous.node_ids if previous else (), joiners)
    return build_plan(number, order, 10_000, 0, "test")


def closed(plan: p.Plan, previous: p.Plan | None) -> bytes:
    return cp.round_value(p.RoundState(plan.round, p.CLOSED, "test"), plan, previous)


def test_a_leave_at_1024_members_carries_an_edit_of_a_few_bytes_not_the_plan():
    joiners = [joiner(f"node-{i:04d}", i) for i in range(1024)]
    before = plan_of(3, joiners)
    after = plan_of(4, joiners[:500] + joiners[501:], before)
    raw = closed(after, before)
    assert len(raw) < 400 < len(before.to_json())
    assert json.loads(raw)["plan_delta"]["runs"] == [[0, 500], [501, 1024]]
    assert cp.carried(raw, {3: before}) == after
    assert cp.carried(raw, {3: before}).member("node-0501").first_rank == 500 * 8
    assert p.RoundState.from_json(raw) == p.RoundState(4, p.CLOSED, "test")


def test_a_join_carries_the_newcomer_record_and_the_member_who_lacks_the_base_reads():
    joiners = [joiner(f"n{i}", i) for i in range(64)]
    before = plan_of(7, joiners)
    newcomer = joiner("late", 99, nproc=2, addr="10.9.9.9", labels=[("zone", "")])
    after = plan_of(8, joiners + [newcomer], before)
    raw = closed(after, before)
    edit = json.loads(raw)["plan_delta"]
    assert edit["runs"][0] == [0, 64] and edit["runs"][1]["id"] == "late"
    assert cp.carried(raw, {7: before}) == after
    assert cp.carried(raw, {}) is None  # a newcomer holds no round 7: it reads the key
    assert cp.carried(raw, {6: before}) is None


def test_a_member_whose_record_changed_is_written_out_not_taken_from_the_base():
    joiners = [joiner(f"n{i}", i) for i in range(32)]
    before = plan_of(1, joiners)
    moved = joiners[:10] + [joiner("n10", 10, addr="192.168.0.7")] + joiners[11:]
    after = plan_of(2, moved, before)
    runs = json.loads(closed(after, before))["plan_delta"]["runs"]
    assert runs[1] == {"id": "n10", "nproc": 8, "addr": "192.168.0.7", "labels": {}}
    assert cp.carried(closed(after, before), {1: before}).member("n10").addr == "192.168.0.7"


def test_the_first_plan_and_a_rewrite_of_most_members_carry_the_whole_plan():
    joiners = [joiner(f"n{i}", i) for i in range(8)]
    first = plan_of(0, joiners)
    assert json.loads(closed(first, None))["plan"] == first.to_dict()
    assert cp.carried(closed(first, None), {}) == first
    others = plan_of(1, [joiner(f"m{i}", 100 + i) for i in range(8)], first)
    assert "plan" in json.loads(closed(others, first))
    assert cp.carried(p.RoundState(2, p.OPEN, "newcomer").to_json(), {1: others}) is None


@pytest.mark.parametrize("edit_change, problem", [
    (lambda e: (e["runs"].append([0, 1]), e.__setitem__("n", 6)), "node ids repeat"),
    (lambda e: e["runs"].__setitem__(0, [0, 99]), "outside round"),
    (lambda e: e.__setitem__("n", 3), "the edit says 3"),
    (lambda e: e.__setitem__("world_size", 1), "wrong world_size"),
    (lambda e: e["runs"].__setitem__(0, "x"), "malformed plan edit"),
])
def test_an_edit_that_is_no_sound_plan_is_refused(edit_change, problem):
    joiners = [joiner(f"n{i}", i) for i in range(6)]
    before = plan_of(1, joiners)
    edit = cp.delta(before, plan_of(2, joiners[:5], before))
    edit_change(edit)
    with pytest.raises(ValueError, match=problem):
        cp.apply(before, edit)
    raw = json.dumps({"number": 2, "state": "closed", "plan_delta": edit}).encode()
    assert cp.carried(raw, {1: before}) is None  # the member reads the plan key instead


@PROPS
@given(st.lists(st.integers(0, 40), unique=True, min_size=1, max_size=30),
       st.lists(st.integers(0, 40), unique=True, min_size=1, max_size=30),
       st.sampled_from(["a", "b"]), st.integers(1, 4))
def test_any_change_of_members_rebuilds_the_plan_exactly(before_ids, after_ids, addr, nproc):
    def make(ids, number, previous):
        return plan_of(number, [joiner(f"n{i}", i, nproc if i % 3 else 1, addr if i % 2 else "h",
                                       [("zone", f"z{i % 2}")] if i % 5 == 0 else ())
                                for i in ids], previous)
    before = make(before_ids, 5, None)
    after = make(after_ids, 6, before)
    assert cp.carried(closed(after, before), {5: before}) == after
    assert cp.apply(before, cp.delta(before, after)) == after
