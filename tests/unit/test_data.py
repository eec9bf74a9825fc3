"""ElasticSampler: exactly-once delivery across resizes, resume and epochs."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_runner.worker.sampler import ElasticSampler, epoch_permutation
from elastic_runner.worker.scaling import BatchPolicy, BatchPolicyError

REPO = Path(__file__).resolve().parents[2]
MakeSampler = Callable[[int, int], ElasticSampler]


def make_ranks(world: int, **kwargs) -> list[ElasticSampler]:
    return [ElasticSampler(rank=r, world_size=world, **kwargs) for r in range(world)]


def global_batches(samplers: list[ElasticSampler]) -> list[tuple[int, list[int]]]:
    """Run all ranks in lockstep; return (step, global batch in rank order)."""
    out = []
    for per_rank in zip(*samplers):
        steps = {step for step, _ in per_rank}
        assert len(steps) == 1
        out.append((steps.pop(), [i for _, idx in per_rank for i in idx]))
    return out


def job_steps(samplers: list[ElasticSampler], num_epochs: int
              ) -> Iterator[tuple[int, int, list[list[int]]]]:
    """The documented resume loop, all ranks in lockstep."""
    for epoch in range(samplers[0].epoch, num_epochs):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        for per_rank in zip(*samplers):
            steps = {step for step, _ in per_rank}
            assert len(steps) == 1
            yield epoch, steps.pop(), [idx for _, idx in per_rank]


def simulate(make: MakeSampler, segments: list[tuple[int, int, int]],
             final_world: int, num_epochs: int) -> list[tuple[int, int, list[int]]]:
    """Restart with each (world, committed, lost) segment, then run to the end.

    Rank 0 checkpoints inside the body of every committed step; the `lost`
    steps after it die with the crash, so the next world must redo them.
    Returns the committed (epoch, step, global batch) in order.
    """
    ckpt = None
    committed: list[tuple[int, int, list[int]]] = []
    for world, commit, lost in [*segments, (final_world, 10**9, 0)]:
        samplers = [make(r, world) for r in range(world)]
        for sampler in samplers:
            if ckpt is not None:
                sampler.load_state_dict(ckpt)
        steps = job_steps(samplers, num_epochs)
        for epoch, step, per_rank in itertools.islice(steps, commit + lost):
            if commit <= 0:
                continue  # work done after the last checkpoint: lost
            commit -= 1
            _check_rank_shares(samplers, per_rank)
            committed.append((epoch, step, [i for idx in per_rank for i in idx]))
            ckpt = samplers[0].state_dict()
            assert all(s.state_dict() == ckpt for s in samplers)
    return committed


def _check_rank_shares(samplers: list[ElasticSampler], per_rank: list[list[int]]) -> None:
    sizes = [len(idx) for idx in per_rank]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    if sum(sizes) == samplers[0].batch_plan.global_batch:
        assert tuple(sizes) == samplers[0].batch_plan.shares


def check_exactly_once(committed, n: int, seed: int, shuffle: bool, num_epochs: int,
                       dropped: Callable[[int], int | None] | None = None) -> None:
    assert [step for _, step, _ in committed] == list(range(1, len(committed) + 1))
    for epoch in range(num_epochs):
        got = [i for e, _, batch in committed if e == epoch for i in batch]
        perm = epoch_permutation(n, seed, epoch, shuffle)
        assert got == perm[:len(got)]  # in order, no repeats
        if dropped is None:
            assert len(got) == n
        else:
            missing = n - len(got)
            expected = dropped(epoch)
            assert missing == expected if expected is not None else missing >= 0


@settings(max_examples=200, deadline=None, database=None)
@given(data=st.data(), n=st.integers(1, 500), global_batch=st.integers(1, 64),
       seed=st.integers(0, 2**32), shuffle=st.booleans(), epochs=st.integers(1, 2),
       drop_last=st.booleans())
def test_exactly_once_across_random_resizes_constant_global(
        data, n, global_batch, seed, shuffle, epochs, drop_last):
    worlds = st.integers(1, min(8, global_batch))
    segments = data.draw(st.lists(st.tuples(worlds, st.integers(0, 40),
                                            st.integers(0, 5)), max_size=6))
    final_world = data.draw(worlds)

    def make(rank: int, world: int) -> ElasticSampler:
        return ElasticSampler(n, global_batch, seed=seed, shuffle=shuffle,
                              drop_last=drop_last, rank=rank, world_size=world)

    committed = simulate(make, segments, final_world, epochs)
    # With a fixed global batch only the final n % G samples can be dropped.
    dropped = (lambda _: n % global_batch) if drop_last else None
    check_exactly_once(committed, n, seed, shuffle, epochs, dropped)


@settings(max_examples=100, deadline=None, database=None)
@given(data=st.data(), n=st.integers(1, 300), per_rank=st.integers(1, 16),
       seed=st.integers(0, 1000), drop_last=st.booleans())
def test_exactly_once_across_random_resizes_constant_local(
        data, n, per_rank, seed, drop_last):
    worlds = st.integers(1, 8)
    segments = data.draw(st.lists(st.tuples(worlds, st.integers(0, 30),
                                            st.integers(0, 3)), max_size=5))
    final_world = data.draw(worlds)
    policy = BatchPolicy.constant_local(per_rank, "sqrt")

    def make(rank: int, world: int) -> ElasticSampler:
        return ElasticSampler(n, seed=seed, drop_last=drop_last, policy=policy,
                              rank=rank, world_size=world)

    committed = simulate(make, segments, final_world, 2)
    # The global batch changes with the world, so only "at most once" and
    # "less than one final global batch missing" can be promised.
    check_exactly_once(committed, n, seed, True, 2,
                       (lambda _: None) if drop_last else None)
    if drop_last:
        for epoch in range(2):
            got = sum(len(b) for e, _, b in committed if e == epoch)
            biggest_world = max([final_world, *(w for w, _, _ in segments)])
            assert n - got < per_rank * biggest_world


def test_fixed_resize_sequence_2_3_1_2():
    def make(rank: int, world: int) -> ElasticSampler:
        return ElasticSampler(1000, 64, seed=7, rank=rank, world_size=world)

    committed = simulate(make, [(2, 3, 1), (3, 4, 2), (1, 2, 0)], 2, 1)
    check_exactly_once(committed, 1000, 7, True, 1)
    assert len(committed) == 16  # ceil(1000 / 64)


@pytest.mark.parametrize("world", range(1, 9))
def test_global_order_is_the_same_for_every_world_size(world):
    batches = global_batches(make_ranks(world, num_samples=200, global_batch_size=24,
                                        seed=3))
    assert [i for _, b in batches for i in b] == epoch_permutation(200, 3, 0)
    assert [s for s, _ in batches] == list(range(1, 10))


def test_permutation_depends_only_on_seed_and_epoch():
    assert epoch_permutation(100, 1, 0) == epoch_permutation(100, 1, 0)
    assert epoch_permutation(100, 1, 0) != epoch_permutation(100, 2, 0)
    assert epoch_permutation(100, 1, 0) != epoch_permutation(100, 1, 1)
    assert epoch_permutation(100, 0, 1) != epoch_permutation(100, 1, 0)
    assert sorted(epoch_permutation(100, 5, 9)) == list(range(100))


def test_same_permutation_in_a_fresh_process_without_torch():
    code = ("import json, sys; from elastic_runner.worker.sampler import epoch_permutation;"
            "assert 'torch' not in sys.modules;"
            "print(json.dumps(epoch_permutation(50, 11, 2)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True,
                         capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO), "PYTHONHASHSEED": "123"})
    assert json.loads(out.stdout) == epoch_permutation(50, 11, 2)


def test_set_epoch_changes_permutation_and_resets_position():
    sampler = ElasticSampler(50, 10, seed=1, rank=0, world_size=1)
    first = [i for _, idx in sampler for i in idx]
    assert list(sampler) == []  # epoch done: the loop just ends
    sampler.set_epoch(0)
    assert list(sampler) == []  # same epoch keeps the position
    sampler.set_epoch(1)
    assert sampler.samples_consumed == 0
    second = [i for _, idx in sampler for i in idx]
    assert first != second and sorted(first) == sorted(second) == list(range(50))
    assert sampler.step == 10


def test_shuffle_false_gives_range_order():
    batches = global_batches(make_ranks(3, num_samples=37, global_batch_size=8,
                                        shuffle=False))
    assert [i for _, b in batches for i in b] == list(range(37))


def test_uneven_split_gives_lowest_ranks_one_more():
    samplers = make_ranks(3, num_samples=20, global_batch_size=10, shuffle=False)
    first = [next(iter(s)) for s in samplers]
    assert [idx for _, idx in first] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_last_partial_batch_split_evenly_with_empty_ranks():
    samplers = make_ranks(3, num_samples=10, global_batch_size=4, shuffle=False)
    per_rank = [list(s) for s in samplers]
    assert [idx for _, idx in per_rank[0]] == [[0, 1], [4, 5], [8]]
    assert [idx for _, idx in per_rank[2]] == [[3], [7], []]


def test_drop_last_drops_only_final_partial_batch():
    samplers = make_ranks(3, num_samples=10, global_batch_size=4, shuffle=False,
                          drop_last=True)
    assert len(samplers[0]) == 2
    assert [i for _, b in global_batches(samplers) for i in b] == list(range(8))
    assert samplers[0].remaining == 2 and len(samplers[0]) == 0


def test_steps_continue_after_load_with_new_world():
    old = make_ranks(2, num_samples=100, global_batch_size=8, seed=4)
    iters = [iter(s) for s in old]
    for _ in range(3):
        for it in iters:
            next(it)
    state = old[0].state_dict()
    assert state["step"] == 3 and state["samples_consumed"] == 24
    new = make_ranks(3, num_samples=100, global_batch_size=8, seed=4)
    for sampler in new:
        sampler.load_state_dict(state)
    step, batch = global_batches(new)[0]
    assert step == 4
    assert batch == epoch_permutation(100, 4, 0)[24:32]


def test_state_taken_inside_loop_body_counts_the_batch():
    sampler = ElasticSampler(30, 10, rank=0, world_size=1)
    for step, _ in sampler:
        if step == 2:
            state = sampler.state_dict()
            break
    assert state["step"] == 2 and state["samples_consumed"] == 20
    resumed = ElasticSampler(30, 10, rank=0, world_size=1)
    resumed.load_state_dict(state)
    assert len(resumed) == 1
    assert [s for s, _ in resumed] == [3]


def test_state_dict_plain_types():
    state = ElasticSampler(10, 4, policy="constant-local:sqrt", rank=1,
                           world_size=2).state_dict()
    assert set(state) == {"version", "epoch", "step", "samples_consumed", "seed",
                          "num_samples", "global_batch_size", "shuffle",
                          "drop_last", "policy"}
    assert all(type(v) in (int, str, bool) for v in state.values())
    assert state["policy"] == "constant-local:sqrt" and state["global_batch_size"] == 8
    assert json.loads(json.dumps(state)) == state


@pytest.mark.parametrize("key,value,match", [
    ("num_samples", 11, "num_samples=11"),
    ("seed", 5, "seed=5"),
    ("shuffle", False, "shuffle=False"),
    ("version", 2, "version"),
    ("samples_consumed", 99, "samples_consumed"),
])
def test_load_rejects_mismatched_state(key, value, match):
    state = ElasticSampler(10, 4, rank=0, world_size=1).state_dict()
    sampler = ElasticSampler(10, 4, rank=0, world_size=1)
    with pytest.raises(ValueError, match=match):
        sampler.load_state_dict(state | {key: value})


def test_load_rejects_foreign_dict():
    with pytest.raises(ValueError, match="missing"):
        ElasticSampler(10, 4, rank=0, world_size=1).load_state_dict({"epoch": 0})


def test_len_and_remaining_follow_the_world():
    sampler = ElasticSampler(100, 30, rank=0, world_size=4)
    assert len(sampler) == 4 and sampler.remaining == 100
    next(iter(sampler))
    assert len(sampler) == 3 and sampler.remaining == 70


def test_defaults_without_process_group():
    sampler = ElasticSampler(10)
    assert (sampler.batch_plan.rank, sampler.batch_plan.world_size) == (0, 1)
    assert sampler.batch_plan.global_batch == 64


def test_constant_local_policy_string_means_per_rank_batch():
    sampler = ElasticSampler(100, 8, policy="constant-local", rank=2, world_size=4)
    plan = sampler.batch_plan
    got = (plan.global_batch, plan.share, plan.offset, plan.lr_factor)
    assert got == (32, 8, 16, 4.0)
    step, indices = next(iter(sampler))
    assert len(indices) == 8


def test_policy_object_conflicting_batch_size_rejected():
    policy = BatchPolicy.constant_global(32)
    sampler = ElasticSampler(10, policy=policy, rank=0, world_size=1)
    assert sampler.batch_plan.global_batch == 32
    with pytest.raises(ValueError, match="conflicts"):
        ElasticSampler(10, 64, policy=policy, rank=0, world_size=1)


def test_global_batch_below_world_rejected():
    with pytest.raises(BatchPolicyError, match="smaller than the world size"):
        ElasticSampler(10, 2, rank=0, world_size=3)


def test_accumulation_helper_splits_yielded_share():
    policy = BatchPolicy.constant_global(64, max_per_rank=10)
    sampler = ElasticSampler(200, policy=policy, rank=1, world_size=2)
    _, indices = next(iter(sampler))
    chunks = sampler.batch_plan.micro_batches(indices)
    assert len(chunks) == sampler.batch_plan.accum_steps == 4
    assert [i for c in chunks for i in c] == indices
    assert max(len(c) for c in chunks) <= 10


def test_set_epoch_during_loop_ends_that_loop():
    sampler = ElasticSampler(40, 10, rank=0, world_size=1)
    seen = []
    for step, _ in sampler:
        seen.append(step)
        sampler.set_epoch(1)
    assert seen == [1] and sampler.samples_consumed == 0


@pytest.mark.parametrize("kwargs", [
    {"num_samples": 0}, {"num_samples": 10, "seed": -1},
    {"num_samples": 10, "policy": 3},
])
def test_bad_arguments_rejected(kwargs):
    with pytest.raises((ValueError, TypeError)):
        ElasticSampler(rank=0, world_size=1, **kwargs)


@pytest.mark.parametrize("flag", ["shuffle", "drop_last"])
@pytest.mark.parametrize("value", ["False", "no", 0, None])
def test_a_flag_that_is_not_a_bool_is_refused(flag, value):
    """Before: shuffle="False" shuffled and drop_last="no" dropped the epoch's last
    batch, both in silence (a string from a config file is true)."""
    with pytest.raises(ValueError, match=f"{flag} must be True or False; got {value!r}"):
        ElasticSampler(100, global_batch_size=8, **{flag: value})
