"""er.init(defer_group=True), the worker's half: no group until er.elastic gives a place.

In this process, with the environment an agent gives a worker of round 3 (rank 1 of
2, a store address nobody listens on: a group formed here would fail or hang).
"""

from __future__ import annotations

import pytest

import elastic_runner as er
from elastic_runner.contract import WorkerEnv
from elastic_runner.errors import NoPlaceYet
from elastic_runner.reform import DEFERRED, STANDBY_ROUND, ReformChannel

ROUND_3 = WorkerEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, round=3,
                    master_addr="127.0.0.1", master_port=9, run_id="unit")


@pytest.fixture
def worker_env(monkeypatch, tmp_path):
    """This process as a worker of round 3 under elastic-run; its channel."""
    from dataclasses import replace

    job = replace(ROUND_3, reform_dir=str(tmp_path / "reform"))
    for name, value in job.to_env().items():
        monkeypatch.setenv(name, value)
    yield ReformChannel(tmp_path / "reform")
    er.finish()


def test_a_deferred_worker_forms_no_group_and_tells_its_agent(worker_env):
    import torch.distributed as dist

    ctx = er.init(defer_group=True, timeout_s=2)
    assert not dist.is_initialized()
    assert (ctx.round, ctx.rank, ctx.world_size) == (STANDBY_ROUND, 1, 2)  # ranks: a guess
    assert er.current() is ctx
    state = worker_env.states()[1]  # by local rank
    assert (state.round, state.phase, state.step) == (STANDBY_ROUND, DEFERRED, -1)


def test_training_outside_er_elastic_without_a_place_fails_in_one_line(worker_env):
    er.init(defer_group=True, timeout_s=2)
    sampler = er.ElasticSampler(64, global_batch_size=8)
    with pytest.raises(er.NoPlaceYet, match="start the sampler's loop inside it") as caught:
        next(iter(sampler))
    assert caught.type is NoPlaceYet and "\n" not in str(caught.value)


def test_a_sharded_state_cannot_defer_its_group(worker_env, monkeypatch):
    """A sharded State keeps the restart path, whose workers need their group from
    er.init(): the worker says what to change instead of training alone."""
    import torch

    from elastic_runner.worker import state as state_module

    er.init(defer_group=True, timeout_s=2)
    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(state_module, "_sharded_types", lambda: (torch.Tensor,))
    state = er.State(model=model)

    @er.elastic(state)
    def train(state):
        raise AssertionError("must not run without a group")

    with pytest.raises(NoPlaceYet, match="drop defer_group=True"):
        train()


def test_outside_elastic_run_defer_group_changes_nothing(monkeypatch, tmp_path):
    """A plain `python train.py` (no launcher): world size 1, no channel to report to."""
    for name in WorkerEnv().to_env():
        monkeypatch.delenv(name, raising=False)
    try:
        ctx = er.init(defer_group=True)
        assert (ctx.round, ctx.rank, ctx.world_size) == (0, 0, 1)
    finally:
        er.finish()
