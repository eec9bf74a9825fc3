"""What a script holds outside its @er.elastic function that re-forming in place breaks.

A DDP wrapper or a group of its own made before the function stays bound to the first
round's process group, which re-forming in place destroys. Before: a node joining two
made the survivors' collectives time out on the old group, the job re-formed in place
four times in 40 s and ended with exit 6 ("DDP expects same model across all ranks").
Now the worker keeps the restart path, where every process makes them on its own
round's group, and says so in one line. A loop's sampler that is not the State's is
named at the first re-formation (its position is not kept).

In this process: a worker of round 0, world 1, under elastic-run (a real gloo group).
"""

from __future__ import annotations

import logging
import os
import socket

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import elastic_runner as er
from elastic_runner.contract import WorkerEnv
from elastic_runner.reform import TRAINING, ReformChannel
from elastic_runner.worker.elastic import Reformer


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def channel(monkeypatch, tmp_path):
    job = WorkerEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, round=0,
                    master_addr="127.0.0.1", master_port=free_port(), run_id="unit",
                    reform_dir=str(tmp_path / "reform"))
    for name, value in job.to_env().items():
        monkeypatch.setenv(name, value)
    er.init(timeout_s=10)
    yield ReformChannel(tmp_path / "reform")
    er.finish()


def test_ddp_built_before_the_training_function_keeps_the_restart_path(channel, caplog):
    model = torch.nn.Linear(3, 1)
    wrapped = DDP(model)
    state = er.State(model=model)

    @er.elastic(state)
    def train(state):
        wrapped(torch.ones(2, 3)).sum().backward()
        return "trained"

    with caplog.at_level(logging.WARNING, logger="elastic_runner.worker.elastic"):
        assert train() == "trained"
    assert channel.states() == {}  # never told its agent it can re-form in place
    lines = [r.getMessage() for r in caplog.records
             if "DistributedDataParallel" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "the script made 1 DistributedDataParallel wrapper(s) before the training " \
           "function" in lines[0] and "this worker keeps the restart path" in lines[0]


def test_a_group_of_its_own_made_before_the_training_function_keeps_the_restart_path(
        channel, caplog):
    import torch.distributed as dist

    side = dist.new_group(backend="gloo")
    state = er.State(model=torch.nn.Linear(3, 1))

    @er.elastic(state)
    def train(state):
        dist.all_reduce(torch.ones(1), group=side)
        return "trained"

    with caplog.at_level(logging.WARNING, logger="elastic_runner.worker.elastic"):
        assert train() == "trained"
    assert channel.states() == {}
    assert "the script made 1 process group(s) of its own before the training function" \
        in caplog.text
    dist.destroy_process_group(side)


def test_the_runtimes_own_groups_are_not_the_scripts(channel):
    """The step boundary's group (made at a first boundary, which a world of one never
    needs: set here as the runtime would)."""
    import torch.distributed as dist

    boundary = er.current().boundary
    boundary._group = dist.new_group(backend="gloo")
    state = er.State(model=torch.nn.Linear(3, 1))

    @er.elastic(state)
    def train(state):
        return "trained"

    assert train() == "trained"
    assert channel.states()[0].phase == TRAINING


def test_ddp_built_inside_the_training_function_re_forms_in_place(channel, caplog):
    model = torch.nn.Linear(3, 1)
    state = er.State(model=model)

    @er.elastic(state)
    def train(state):
        DDP(model)(torch.ones(2, 3)).sum().backward()
        return "trained"

    with caplog.at_level(logging.WARNING, logger="elastic_runner.worker.elastic"):
        assert train() == "trained"
    assert channel.states()[0].phase == TRAINING  # the agent learns it can re-form in place
    assert not [r for r in caplog.records if "DistributedDataParallel" in r.getMessage()]


def test_a_loop_sampler_outside_the_state_is_named_once_at_a_re_formation(channel, caplog):
    """er.State(model=...) with the ElasticSampler left out: its position is neither kept
    nor sent to new ranks, so a re-formation trains samples twice; before, in silence."""
    outside = er.ElasticSampler(8, global_batch_size=2)
    kept = er.ElasticSampler(8, global_batch_size=2)
    context = er.current()
    reformer = Reformer(er.State(model=torch.nn.Linear(3, 1), sampler=kept), context,
                        channel, WorkerEnv.from_env(os.environ))
    with caplog.at_level(logging.WARNING, logger="elastic_runner.worker.elastic"):
        context.boundary.sampler = kept
        reformer._check_state_covers_the_loop()
        assert not caplog.records  # the State's own sampler
        for _ in range(2):
            context.boundary.sampler = outside
            reformer._check_state_covers_the_loop()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "is not the one in er.State" in line and "er.State(sampler=...)" in line


def test_the_sampler_loop_tells_the_runtime_which_sampler_it_is(channel):
    sampler = er.ElasticSampler(8, global_batch_size=2)
    next(iter(sampler))
    assert er.current().boundary.sampler is sampler


def test_an_lr_scheduler_left_out_of_the_state_is_named_before_training(channel, caplog):
    """A warm-up scheduler of the State's optimizer, outside the State: after a join in
    place the newcomer's rate was its warm-up's first while the others' was theirs, and
    192 of the next 200 steps had replicas that disagreed (tests/helpers/inproc_worker.py
    --scheduler-outside-state, 2 + 1 nodes), every worker exiting 0. Now the line comes
    before the first step, while the worker still re-forms in place."""
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    warm_up = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / 10)
    state = er.State(model=model, optimizer=optimizer)
    seen = []

    @er.elastic(state)
    def train(state):
        seen.extend(r.getMessage() for r in caplog.records)
        return "trained"

    with caplog.at_level(logging.WARNING, logger="elastic_runner.worker.elastic"):
        assert train() == "trained"
    assert any("LR scheduler of er.State's optimizer 'optimizer' is not in er.State" in line
               for line in seen)
    assert channel.states()[0].phase == TRAINING
    assert warm_up.last_epoch == 0
