"""Format 2 of the plan record: columnar, read back exactly, old form still read (no I/O)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.ranks import build_plan

PROPS = settings(max_examples=200, deadline=None)

NODE_IDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=8)


def columnar_plan(nprocs, addrs, labels=None) -> p.Plan:
    labels = labels or {}
    ordered = [p.Joiner(f"n{i}", addr, 29500, nproc, i, tuple(sorted(labels.get(i, {}).items())))
               for i, (nproc, addr) in enumerate(zip(nprocs, addrs))]
    return build_plan(2, ordered, len(ordered), 0, "start")


@pytest.mark.parametrize("nprocs, addrs, labels, nproc_field, addrs_field", [
    ([4, 4, 4], ["h"] * 3, None, 4, "h"),
    ([1, 8, 2], ["h"] * 3, None, [1, 8, 2], "h"),
    ([2, 2, 2], ["h1", "h2", "h1"], None, 2, ["h1", "h2", "h1"]),
    ([2, 1], ["h1", "h2"], {1: {"zone": "b", "rack": "r2"}}, [2, 1], ["h1", "h2"]),
])
def test_plan_json_is_columnar_and_round_trips(nprocs, addrs, labels, nproc_field, addrs_field):
    plan = columnar_plan(nprocs, addrs, labels)
    record = json.loads(plan.to_json())
    assert record["format"] == 2 and record["ids"] == list(plan.node_ids)
    assert (record["nproc"], record["addrs"]) == (nproc_field, addrs_field)
    assert record["world_size"] == sum(nprocs)
    assert "node_rank" not in plan.to_json().decode()  # ranks follow from order and nproc
    assert record.get("labels") == ([{}, {"rack": "r2", "zone": "b"}] if labels else None)
    assert p.Plan.from_json(plan.to_json()) == plan


@PROPS
@given(st.lists(st.tuples(NODE_IDS, st.integers(0, 8), st.sampled_from(["h1", "h2"]),
                          st.dictionaries(st.sampled_from(["zone", "rack"]), NODE_IDS,
                                          max_size=2)),
                min_size=0, max_size=8, unique_by=lambda t: t[0]))
def test_plan_json_round_trip_property_columns(nodes):
    members, first = [], 0
    for rank, (node, nproc, addr, labels) in enumerate(nodes):
        members.append(p.Member(node, rank, nproc, addr, first, tuple(sorted(labels.items()))))
        first += nproc
    plan = p.Plan(7, tuple(members), "h1", 1234, 2, "newcomer")
    raw = plan.to_json()
    assert p.Plan.from_json(raw) == plan
    assert p.Plan.from_json(raw).to_json() == raw  # one plan, one spelling


def test_plan_json_reads_the_per_member_form_earlier_agents_wrote():
    older = (b'{"cause": "newcomer", "master_addr": "10.0.0.1", "master_port": 4000, "members": '
             b'[{"addr": "10.0.0.1", "first_rank": 0, "labels": {"zone": "z1"}, "node_id": "a", '
             b'"node_rank": 0, "nproc": 2}, {"addr": "10.0.0.2", "first_rank": 2, "labels": {}, '
             b'"node_id": "b", "node_rank": 1, "nproc": 3}], "restart_count": 1, "round": 4, '
             b'"world_size": 5}')
    ordered = [p.Joiner("a", "10.0.0.1", 4000, 2, 1, (("zone", "z1"),)),
               p.Joiner("b", "10.0.0.2", 29500, 3, 2)]
    plan = build_plan(4, ordered, 4, 1, "newcomer")
    assert p.Plan.from_json(older) == plan
    assert p.Plan.from_json(plan.to_json()) == plan


def test_plan_json_bytes_are_deterministic():
    ordered = [p.Joiner(f"n{i}", f"10.0.0.{i % 2}", 29500, 1 + i % 3, i) for i in range(6)]
    first, second = (build_plan(5, list(ordered), 8, 0, "start") for _ in range(2))
    assert first is not second and first.to_json() == second.to_json()


def test_plan_json_of_1024_members_is_tens_of_kilobytes():
    ordered = [p.Joiner(f"s{i:04d}", "127.0.0.1", 29500, 8, i) for i in range(1024)]
    plan = build_plan(1, ordered, 1024, 0, "start")
    raw = plan.to_json()
    assert len(raw) < 32_000  # the per-member form took about 110 KB
    assert p.Plan.from_json(raw) == plan and plan.world_size == 8192


DROP = object()
PLAN_V2 = {"format": 2, "round": 1, "master_addr": "h", "master_port": 1, "restart_count": 0,
           "cause": "start", "world_size": 4, "ids": ["a", "b"], "nproc": 2, "addrs": "h"}


@pytest.mark.parametrize("change, message", [
    ({"ids": "ab"}, "ids is not a list"),
    ({"ids": None}, "ids is not a list"),
    ({"nproc": [2, 2, 2]}, "length"),
    ({"addrs": ["h"]}, "length"),
    ({"labels": [{}]}, "length"),
    ({"nproc": [2, -2], "world_size": 0}, "nproc"),
    ({"nproc": "2"}, "nproc"),
    ({"nproc": True}, "nproc"),
    ({"ids": ["a", 3]}, "strings"),
    ({"addrs": 7}, "strings"),
    ({"ids": ["a", "a"]}, "repeat"),
    ({"world_size": 5}, "world_size"),
    ({"format": 3}, "format 3"),
    ({"round": DROP}, "round"),
    ({"labels": ["zone", "rack"]}, "malformed"),
])
def test_plan_json_refuses_a_malformed_record(change, message):
    record = {key: value for key, value in {**PLAN_V2, **change}.items() if value is not DROP}
    with pytest.raises(ValueError, match=message):
        p.Plan.from_json(json.dumps(record).encode())


@pytest.mark.parametrize("raw", [b"", b"[1, 2]", b"7", b"null",
                                 b'{"round": 1, "members": [{"node_id": "a"}]}'])
def test_plan_json_refuses_what_is_no_plan_at_all(raw):
    with pytest.raises(ValueError):
        p.Plan.from_json(raw)


def test_plan_to_json_refuses_ranks_the_columns_cannot_hold():
    gap = p.Plan(0, (p.Member("a", 0, 2, "h", 0), p.Member("b", 1, 2, "h", 3)), "h", 1)
    with pytest.raises(ValueError, match="ranks do not follow"):
        gap.to_json()


def test_a_superseded_plan_reads_as_none_and_a_whole_one_reads_back():
    plan = columnar_plan([2, 2], ["h", "h"])
    assert p.plan_from(p.SUPERSEDED_PLAN) is None
    assert p.plan_from(plan.to_json()) == plan


@pytest.mark.parametrize("closing, emptied", [(0, None), (1, None), (2, 0), (7, 5)])
def test_closing_a_round_empties_the_plan_two_back_and_drops_that_rounds_torch_store(
        closing, emptied):
    from elastic_runner.etcd.values import Delete, Put
    from elastic_runner.rendezvous.old_rounds import superseded_by

    ops = superseded_by("/r/", closing)
    if emptied is None:
        assert ops == []
    else:
        assert ops == [Put(p.plan_key("/r/", emptied), p.SUPERSEDED_PLAN),
                       Delete(p.store_prefix("/r/", emptied), prefix=True)]
