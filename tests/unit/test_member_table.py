"""A plan read from etcd keeps its members as columns: it must behave exactly as the
tuple of Members it stands for (no I/O)."""

from __future__ import annotations

import pickle

import pytest

from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.member_table import MemberTable
from elastic_runner.rendezvous.ranks import assign_ranks, build_plan, plan_problem

LABELS = (("rack", "r1"), ("zone", "a"))


def built() -> p.Plan:
    joiners = [p.Joiner("a", "h1", 1, 2, 1), p.Joiner("b", "h2", 1, 3, 2, LABELS),
               p.Joiner("c", "h1", 1, 1, 3)]
    return build_plan(5, joiners, 8, 0, "test")


def test_a_parsed_plan_equals_the_built_one_member_by_member():
    plan = built()
    parsed = p.Plan.from_json(plan.to_json())
    assert isinstance(parsed.members, MemberTable) and isinstance(plan.members, tuple)
    assert parsed == plan and plan == parsed and hash(parsed) == hash(plan)
    assert list(parsed.members) == list(plan.members)
    assert parsed.members[-1] == p.Member("c", 2, 1, "h1", 5)
    assert parsed.members[1:] == plan.members[1:]
    assert parsed.member("b") == p.Member("b", 1, 3, "h2", 2, LABELS)
    assert parsed.member("zz") is None
    assert (parsed.node_ids, parsed.world_size) == (("a", "b", "c"), 6)
    assert assign_ranks(parsed, "b") == assign_ranks(plan, "b")
    assert plan_problem(parsed) is None and parsed.describe() == plan.describe()
    assert pickle.loads(pickle.dumps(parsed)) == plan


def test_a_member_table_is_immutable_and_indexes_as_a_tuple():
    table = p.Plan.from_json(built().to_json()).members
    with pytest.raises(AttributeError):
        table.ids = ("x",)
    with pytest.raises(IndexError):
        table[3]
    assert table[-3].node_id == "a" and table[::2] == (table[0], table[2])
    assert table != built().members[:2] and table != "abc"
    assert MemberTable.of(built().members) == table
