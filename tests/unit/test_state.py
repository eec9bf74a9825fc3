"""er.State and er.elastic, the parts that need no peer: which step a State holds,
who sends to whom, what travels, what counts as a failed collective, and what the
step boundary and a paused worker do on their own (no process group, except the
one-rank group a DTensor needs)."""

from __future__ import annotations

import pickle

import pytest
import torch

import elastic_runner as er
from elastic_runner.contract import EXIT_FOR_RESIZE, WorkerEnv
from elastic_runner.reform import FAILED, PAUSED, Assignment, ReformChannel
from elastic_runner.worker import elastic, job_checkpointer, runtime, state_transfer
from elastic_runner.worker import sampler as sampler_module
from elastic_runner.worker.sampler import ElasticSampler
from elastic_runner.worker.state import ShardedStateError, State, plan_transfer
from elastic_runner.worker.step_boundary import ReformRequested


def make_state(samples: int = 40, batch: int = 4) -> State:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return State(model=model, optimizer=optimizer,
                 sampler=ElasticSampler(samples, global_batch_size=batch, rank=0, world_size=1))


def train_one_step(state: State) -> int:
    step, indices = next(iter(state.sampler))
    state.optimizer.zero_grad()
    state.model(torch.ones(len(indices), 3)).sum().backward()
    state.optimizer.step()
    return step


# ---- the State on its own ------------------------------------------------------------
def test_a_state_is_a_mapping_of_its_objects_with_attribute_access():
    state = make_state()
    assert list(state) == ["model", "optimizer", "sampler"] and len(state) == 3
    assert state["model"] is state.model and state.sampler is state["sampler"]
    with pytest.raises(AttributeError, match="no object named 'nope'"):
        state.nope


def test_a_state_refuses_objects_without_state_dicts():
    with pytest.raises(TypeError, match="extra=int"):
        State(model=torch.nn.Linear(1, 1), extra=3)
    with pytest.raises(TypeError, match="at least one"):
        State()


def test_the_step_is_unknown_until_a_step_completes_and_then_follows_commits():
    state = make_state()
    assert state.step == -1
    state.commit(train_one_step(state))
    assert state.step == 1
    no_sampler = State(model=torch.nn.Linear(1, 1))
    no_sampler.commit()
    no_sampler.commit()
    assert no_sampler.step == 2


def test_rollback_hands_out_a_step_cut_short_again():
    state = make_state()
    state.commit(train_one_step(state))
    position = state.sampler.state_dict()
    iterator = iter(state.sampler)
    cut_short, indices = next(iterator)  # handed out, but its collective failed
    assert cut_short == 2 and state.sampler.step == 2
    state.rollback()
    assert state.sampler.state_dict() == position and state.step == 1
    assert next(iter(state.sampler)) == (2, indices)


def test_restore_loads_the_newest_checkpoint_and_takes_its_step(tmp_path):
    state = make_state()
    for _ in range(3):
        state.commit(train_one_step(state))
    ckpt = er.Checkpointer(tmp_path / "ckpt", rank=0)
    ckpt.save(3, state)
    fresh = make_state()
    assert State(model=torch.nn.Linear(3, 2)).restore(er.Checkpointer(tmp_path / "empty")) is None
    assert fresh.restore(er.Checkpointer(tmp_path / "ckpt")) == 3
    assert fresh.step == 3 and fresh.sampler.step == 3
    assert torch.equal(fresh.model.weight, state.model.weight)


def test_the_transferred_states_carry_every_object_and_the_step():
    """What a receiver loads: the skeleton (pickled) filled with copies of the tensors."""
    source, receiver = make_state(), make_state()
    for _ in range(2):
        source.commit(train_one_step(source))
    skeleton, tensors = state_transfer.split(source._states())
    skeleton = pickle.loads(pickle.dumps(skeleton))
    assert [slot.index for slot in state_transfer.slots(skeleton)] == list(range(len(tensors)))
    receiver._load(state_transfer.fill(skeleton, [tensor.clone() for tensor in tensors]))
    assert receiver.step == 2 and receiver.sampler.state_dict() == source.sampler.state_dict()
    assert torch.equal(receiver.model.weight, source.model.weight)
    momentum = [s["momentum_buffer"] for s in receiver.optimizer.state_dict()["state"].values()]
    assert momentum and all(torch.equal(a, b["momentum_buffer"]) for a, b in zip(
        momentum, source.optimizer.state_dict()["state"].values()))


def test_sync_without_a_process_group_moves_nothing():
    state = make_state()
    assert state.sync() == 0
    assert state.last_sync.source is None and state.last_sync.received == 0


@pytest.mark.parametrize("steps, source, behind", [
    ([5, 5, 5], 0, ()),  # everyone current: nobody moves a byte
    ([-1, -1], 0, ()),  # a fresh job: nobody holds more than the others
    ([9, 9, -1], 0, (2,)),  # a newcomer
    ([8, 9, 9], 1, (0,)),  # a survivor one step behind; the lowest holder of 9 sends
    ([3, 7, -1, 7], 1, (0, 2)),
])
def test_the_source_is_the_lowest_rank_with_the_newest_step(steps, source, behind):
    assert plan_transfer(steps) == (source, behind)


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_sharded_state_is_refused_with_a_typed_error(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Linear(2, 2)
    state = State(model=model)
    state.check_replicated()  # plain tensors: fine
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(ShardedStateError, match=r"sharded tensor \(model.weight\)"):
        state.check_replicated()
    with pytest.raises(ShardedStateError):
        state.sync()


# ---- what counts as a failed collective -------------------------------------------------
@pytest.mark.parametrize("text", [
    "[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1. This is...",
    "[/x/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:2: Connection reset by peer.",
    "[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation",
])
def test_gloo_errors_are_collective_failures_named_by_their_first_line(text):
    assert elastic.collective_failure(RuntimeError(text + "\nmore detail")) == text


def test_torch_distributed_errors_are_collective_failures_and_others_are_not():
    import torch.distributed as dist

    assert elastic.collective_failure(dist.DistNetworkError("store gone")) == "store gone"
    assert elastic.collective_failure(RuntimeError("mat1 and mat2 shapes cannot be")) is None
    assert elastic.collective_failure(RuntimeError("Tensors must be CPU and dense (gloo)")) is None
    assert elastic.collective_failure(ValueError("Connection reset by peer")) is None


def test_a_collective_that_keeps_failing_at_one_step_fails_the_worker(context, tmp_path,
                                                                      monkeypatch):
    """Re-forming cannot cure a script's own error: after MAX_FAILURES_PER_STEP rounds
    that all failed at the same step, the error is raised (the restart path counts it)."""
    import torch.distributed as dist

    worker = paused_worker(context, tmp_path)
    reforms = []
    monkeypatch.setattr(worker, "_reform", reforms.append)

    def train():
        raise dist.DistBackendError("invalid usage")

    with pytest.raises(dist.DistBackendError):
        worker.run(train)
    assert len(reforms) == elastic.MAX_FAILURES_PER_STEP
    assert all(reason == "collective-error: invalid usage" for reason in reforms)


# ---- the step boundary under er.elastic, one rank -----------------------------------------
@pytest.fixture
def context(tmp_path, monkeypatch):
    ctx = runtime.context_from_env({"ELASTIC_RUN_NOTICE_PATH": str(tmp_path / "notice"),
                                    "ELASTIC_RUN_ROUND": "4"}, "gloo", "cpu")
    monkeypatch.setattr(runtime, "_active", [ctx])
    return ctx


def test_an_asked_pause_raises_reform_requested_after_the_step_completes(context):
    state = make_state()
    context.boundary.pause_asked = lambda: True
    context.boundary.on_completed = state.commit
    with pytest.raises(ReformRequested) as stop:
        for step, _ in state.sampler:
            pass
    assert stop.value.step == 1 and state.step == 1 and state.sampler.step == 1


def test_a_notice_on_every_rank_saves_as_on_the_restart_path(context, tmp_path):
    state = make_state()
    ckpt = job_checkpointer.Checkpointer(tmp_path / "ckpt", rank=0)
    ckpt.register(state)
    context.boundary.pause_asked = lambda: False
    (tmp_path / "notice").touch()  # the one rank leaves: nobody keeps the state
    with pytest.raises(SystemExit) as leave:
        for _ in state.sampler:
            pass
    assert leave.value.code == EXIT_FOR_RESIZE
    assert (tmp_path / "ckpt" / "step-00000001" / "MANIFEST.json").exists()


def test_without_er_elastic_an_asked_pause_is_ignored(context):
    sampler = ElasticSampler(8, global_batch_size=4, rank=0, world_size=1)
    ReformChannel(context.notice_path + ".reform").ask_pause(4)  # nobody listens
    assert [step for step, _ in sampler] == [1, 2]


# ---- er.elastic ---------------------------------------------------------------------
def test_outside_elastic_run_the_function_is_called_once(monkeypatch):
    monkeypatch.delenv("ELASTIC_RUN_REFORM_DIR", raising=False)
    state = make_state()

    @er.elastic(state)
    def train(got, factor):
        assert got is state
        return 7 * factor

    assert train(2) == 14


def test_er_elastic_needs_a_state():
    with pytest.raises(TypeError, match="er.State"):
        er.elastic({"model": torch.nn.Linear(1, 1)})


def test_er_elastic_without_its_state_argument_or_function_says_so_at_once():
    def train(state):
        pass

    with pytest.raises(TypeError, match="needs an er.State, got function"):
        er.elastic(train)  # @er.elastic instead of @er.elastic(state)
    with pytest.raises(TypeError, match="decorates a training function, got int"):
        er.elastic(make_state())(123)


def paused_worker(context, tmp_path, timeout_s: float = 60.0) -> elastic.Reformer:
    channel = ReformChannel(tmp_path / "reform")
    return elastic.Reformer(make_state(), context, channel,
                            WorkerEnv(reform_dir=str(channel.directory)), timeout_s)


def test_a_worker_never_assigned_a_place_reports_failed_and_exits(context, tmp_path):
    worker = paused_worker(context, tmp_path, timeout_s=0.05)
    worker.channel.assign(0, Assignment(4, rank=0, world_size=1))  # this round: not new
    with pytest.raises(SystemExit) as leave:
        worker._await_assignment()
    assert leave.value.code == EXIT_FOR_RESIZE
    report = worker.channel.states()[0]
    assert report.phase == FAILED and "no assignment for a round after 4" in report.reason


def test_a_worker_told_to_leave_exits_without_a_checkpoint(context, tmp_path):
    worker = paused_worker(context, tmp_path)
    worker.channel.assign(0, Assignment(5, leave=True))
    assignment = worker._await_assignment()
    assert assignment.leave
    with pytest.raises(SystemExit) as leave:
        worker._leave_job(assignment)
    assert leave.value.code == EXIT_FOR_RESIZE and runtime.current() is None
    report = worker.channel.states()[0]
    assert report.phase == PAUSED and report.reason == "leaving: not in round 5"


# ---- the sampler follows a re-formed group ---------------------------------------------
def test_the_sampler_splits_anew_when_the_group_changes(monkeypatch):
    world = {"now": (1, 3)}
    monkeypatch.setattr(sampler_module, "_torch_rank_world",
                        lambda alone=(0, 1): world["now"])
    sampler = ElasticSampler(24, global_batch_size=6, shuffle=False)
    first = next(iter(sampler))
    assert first == (1, [2, 3]) and sampler.batch_plan.world_size == 3
    world["now"] = (0, 2)  # re-formed: this process is rank 0 of 2
    assert next(iter(sampler)) == (2, [6, 7, 8])
    pinned = ElasticSampler(24, global_batch_size=6, shuffle=False, rank=0, world_size=1)
    assert next(iter(pinned))[1] == list(range(6))  # a given world is kept
