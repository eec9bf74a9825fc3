"""A script that wraps its model in DDP before its @er.elastic function.

Such a DDP stays bound to the first round's process group, which re-forming in place
destroys. Before: a node joining two made the survivors' backward time out on the old
group, the job re-formed in place four times in 40 s and ended with exit 6 ("DDP
expects same model across all ranks"). Now the worker keeps the restart path, where
every process builds its DDP on its own round's group, and says so in one line.

In this process: a worker of round 0, world 1, under elastic-run (a real gloo group).
"""

from __future__ import annotations

import logging
import socket

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import elastic_runner as er
from elastic_runner.contract import WorkerEnv
from elastic_runner.reform import TRAINING, ReformChannel


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
