"""Batch policies: shares, accumulation, learning-rate factors and parsing."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_runner.errors import ConfigError
from elastic_runner.worker.scaling import (
    ACCEPTED_POLICIES,
    BatchPolicy,
    BatchPolicyError,
    normalize_policy,
    parse_policy,
    plan_batch,
    split_evenly,
)


def all_plans(policy: BatchPolicy, world: int):
    return [plan_batch(policy, world, rank) for rank in range(world)]


@settings(max_examples=200, deadline=None, database=None)
@given(world=st.integers(1, 64), data=st.data())
def test_constant_global_shares_sum_and_balance(world, data):
    global_batch = data.draw(st.integers(world, 4096))
    plans = all_plans(BatchPolicy.constant_global(global_batch), world)
    shares = [p.share for p in plans]
    assert sum(shares) == global_batch
    assert max(shares) - min(shares) <= 1
    assert shares == sorted(shares, reverse=True)  # extra goes to low ranks
    assert all(p.shares == tuple(shares) for p in plans)
    assert [p.offset for p in plans] == [sum(shares[:r]) for r in range(world)]
    assert all(p.lr_factor == 1.0 and p.global_batch == global_batch for p in plans)


def test_remainder_goes_to_lowest_ranks():
    plans = all_plans(BatchPolicy.constant_global(64), 3)
    assert [p.share for p in plans] == [22, 21, 21]
    assert [p.offset for p in plans] == [0, 22, 43]


def test_describe_is_one_line_summary():
    plan = plan_batch(BatchPolicy.constant_global(64), 3, 1)
    assert plan.describe() == (
        "constant-global: global 64 = 22+21+21 over 3 ranks, lr x1.00")
    assert str(plan) == plan.describe()
    local = plan_batch(BatchPolicy.constant_local(32, "sqrt"), 3, 0)
    assert str(local) == (
        "constant-local:sqrt: global 96 = 32+32+32 over 3 ranks, lr x1.73")


def test_describe_groups_large_worlds_and_shows_accumulation():
    plan = plan_batch(BatchPolicy.constant_global(100, max_per_rank=2), 16, 0)
    assert "7x4+6x12" in plan.describe()
    assert "accum 4 x <=2" in plan.describe()
    assert "\n" not in plan.describe()


def test_global_batch_below_world_is_an_error():
    with pytest.raises(BatchPolicyError, match="smaller than the world size 8"):
        plan_batch(BatchPolicy.constant_global(4), 8, 0)
    assert issubclass(BatchPolicyError, ValueError)
    assert issubclass(BatchPolicyError, ConfigError)


def test_accumulation_splits_share_into_capped_micro_batches():
    plan = plan_batch(BatchPolicy.constant_global(256, max_per_rank=32), 2, 0)
    assert plan.share == 128
    assert plan.accum_steps == 4
    assert plan.micro_batch_sizes == (32, 32, 32, 32)
    chunks = plan.micro_batches(list(range(128)))
    assert [len(c) for c in chunks] == [32] * 4
    assert [i for c in chunks for i in c] == list(range(128))


def test_no_accumulation_when_share_fits():
    plan = plan_batch(BatchPolicy.constant_global(64, max_per_rank=32), 2, 1)
    assert plan.accum_steps == 1
    assert plan.micro_batch_sizes == (32,)


@settings(max_examples=200, deadline=None, database=None)
@given(world=st.integers(1, 16), cap=st.integers(1, 64), data=st.data())
def test_accum_steps_equal_on_all_ranks_and_respect_cap(world, cap, data):
    global_batch = data.draw(st.integers(world, 2048))
    plans = all_plans(BatchPolicy.constant_global(global_batch, cap), world)
    accum = {p.accum_steps for p in plans}
    assert accum == {math.ceil(plans[0].share / cap)}
    for plan in plans:
        assert sum(plan.micro_batch_sizes) == plan.share
        assert max(plan.micro_batch_sizes) <= cap


def test_micro_batches_of_short_final_batch_keep_count():
    plan = plan_batch(BatchPolicy.constant_global(64, max_per_rank=8), 2, 0)
    chunks = plan.micro_batches([1, 2, 3])
    assert len(chunks) == plan.accum_steps == 4
    assert chunks == [[1], [2], [3], []]


@pytest.mark.parametrize("world,base,rule,expected", [
    (1, 1, "linear", 1.0), (4, 1, "linear", 4.0), (2, 4, "linear", 0.5),
    (4, 1, "sqrt", 2.0), (8, 2, "sqrt", 2.0), (3, 1, "sqrt", math.sqrt(3)),
])
def test_constant_local_lr_factor(world, base, rule, expected):
    policy = BatchPolicy.constant_local(16, rule, base_world_size=base)
    plan = plan_batch(policy, world, world - 1)
    assert plan.lr_factor == pytest.approx(expected)
    assert plan.global_batch == 16 * world
    assert plan.share == 16 and plan.offset == 16 * (world - 1)


@pytest.mark.parametrize("text,name,rule", [
    ("constant-global", "constant-global", None),
    ("constant-local", "constant-local", "linear"),
    ("constant-local:linear", "constant-local", "linear"),
    (" Constant-Local:SQRT ", "constant-local", "sqrt"),
])
def test_parse_policy_accepts(text, name, rule):
    policy = parse_policy(text, 32)
    assert (policy.name, policy.lr_rule, policy.batch_size) == (name, rule, 32)
    assert parse_policy(policy.spec, 32) == policy


@pytest.mark.parametrize("text", [
    "", "constant", "constant-global:sqrt", "constant-local:cubic", "linear",
])
def test_parse_policy_rejects_with_accepted_list(text):
    with pytest.raises(ValueError) as info:
        parse_policy(text, 32)
    for accepted in ACCEPTED_POLICIES:
        assert accepted in str(info.value)


def test_normalize_policy_canonical():
    assert normalize_policy("constant-local") == "constant-local:linear"
    assert normalize_policy("CONSTANT-GLOBAL") == "constant-global"


@pytest.mark.parametrize("kwargs", [
    {"batch_size": 0}, {"batch_size": -3}, {"max_per_rank": 0},
    {"base_world_size": 0},
])
def test_bad_sizes_rejected(kwargs):
    args = {"batch_size": 8, "max_per_rank": None, "base_world_size": 1} | kwargs
    with pytest.raises(BatchPolicyError):
        parse_policy("constant-local", args["batch_size"],
                     base_world_size=args["base_world_size"],
                     max_per_rank=args["max_per_rank"])


def test_bad_rank_or_world_rejected():
    policy = BatchPolicy.constant_global(8)
    with pytest.raises(BatchPolicyError, match="outside a world"):
        plan_batch(policy, 2, 2)
    with pytest.raises(BatchPolicyError, match="world_size"):
        plan_batch(policy, 0, 0)


def test_policy_and_plan_are_frozen():
    policy = BatchPolicy.constant_global(8)
    plan = plan_batch(policy, 2, 0)
    with pytest.raises(AttributeError):
        policy.batch_size = 4  # type: ignore[misc]
    with pytest.raises(AttributeError):
        plan.offset = 1  # type: ignore[misc]


def test_split_evenly():
    assert split_evenly(5, 3) == (2, 2, 1)
    assert split_evenly(2, 4) == (1, 1, 0, 0)
    assert split_evenly(0, 2) == (0, 0)
