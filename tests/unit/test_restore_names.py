"""restore(objects) with an object the checkpoint holds nothing for (both formats).

Before: the object was skipped without a word and restore() returned the step, so a
key renamed between two launches ('model' to 'net') resumed at step N with untrained
weights, and the next saves, `keep` at a time, deleted the trained ones.
"""

from __future__ import annotations

import pytest
import torch

from elastic_runner.errors import CheckpointError
from elastic_runner.worker.checkpoint.checkpointer import Checkpointer, MemoryLatestStore
from elastic_runner.worker.state import State
from tests.unit.test_sharded_checkpoint import group, objects, same, train  # noqa: F401


def module(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def weights(m: torch.nn.Module) -> list:
    return [t.clone() for t in m.state_dict().values()]


def test_a_renamed_object_is_one_error_and_nothing_is_loaded(tmp_path):
    ckpt = Checkpointer(tmp_path, rank=0)
    ckpt.save(20, {"model": module(0).state_dict(), "optim": {"lr": 0.1}})
    net, opt = module(1), torch.optim.SGD(module(2).parameters(), lr=0.5)
    before, opt_before = weights(net), opt.state_dict()["param_groups"][0]["lr"]
    with pytest.raises(CheckpointError) as refused:
        Checkpointer(tmp_path, rank=0).restore({"net": net, "optim": opt})
    message = str(refused.value)
    assert "\n" not in message
    assert "checkpoint step 20 (file://" in message
    assert "holds nothing for 'net' (it holds 'model', 'optim')" in message
    assert "allow_missing=['net']" in message
    assert all(torch.equal(a, b) for a, b in zip(weights(net), before))  # untouched
    assert opt.state_dict()["param_groups"][0]["lr"] == opt_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000020"]  # nothing lost


def test_an_object_new_in_the_script_loads_the_rest_when_allowed(tmp_path):
    saved = module(0)
    Checkpointer(tmp_path, rank=0).save(20, {"model": saved.state_dict()})
    model, scheduler_like = module(1), module(2)
    kept = weights(scheduler_like)
    step = Checkpointer(tmp_path, rank=0).restore(
        {"model": model, "extra": scheduler_like}, allow_missing=["extra"])
    assert step == 20 and torch.equal(model.weight, saved.weight)
    assert all(torch.equal(a, b) for a, b in zip(weights(scheduler_like), kept))


def test_a_checkpoint_of_a_single_tensor_holds_no_objects(tmp_path):
    Checkpointer(tmp_path, rank=0).save(5, torch.ones(3))
    with pytest.raises(CheckpointError,
                       match="holds nothing for 'model' \\(it holds no objects\\)"):
        Checkpointer(tmp_path, rank=0).restore({"model": module(0)})


def test_state_restore_passes_allow_missing_on(tmp_path):
    Checkpointer(tmp_path, rank=0).save(7, {"model": module(0).state_dict()})
    state = State(model=module(1), ema=module(2))
    with pytest.raises(CheckpointError, match="holds nothing for 'ema'"):
        state.restore(Checkpointer(tmp_path, rank=0))
    assert state.restore(Checkpointer(tmp_path, rank=0), allow_missing=("ema",)) == 7


def test_the_sharded_format_refuses_the_same_on_every_rank(group, tmp_path):  # noqa: F811
    saved = objects()
    train(saved, 2)
    store = MemoryLatestStore()
    Checkpointer(tmp_path, sharded=True, latest_store=store).save(2, saved)
    renamed = objects(seed=1)
    renamed["net"] = renamed.pop("model")
    untouched = objects(seed=1)
    with pytest.raises(CheckpointError) as refused:
        Checkpointer(tmp_path, sharded=True, latest_store=store).restore(renamed)
    assert "holds nothing for 'net' (it holds 'model', 'optim', 'sampler')" in str(refused.value)
    assert same({"optim": renamed["optim"]}, {"optim": untouched["optim"]})  # nothing loaded
    fresh = objects(seed=1)
    fresh["extra"] = module(3)
    assert Checkpointer(tmp_path, sharded=True, latest_store=store).restore(
        fresh, allow_missing=["extra"]) == 2
    assert same({k: fresh[k] for k in ("model", "optim", "sampler")}, saved)


def test_one_name_given_as_a_string_is_that_name_not_its_letters(tmp_path):
    Checkpointer(tmp_path, rank=0).save(3, {"model": module(0).state_dict()})
    assert Checkpointer(tmp_path, rank=0).restore(
        {"model": module(1), "ema": module(2)}, allow_missing="ema") == 3
    with pytest.raises(CheckpointError, match="holds nothing for 'ame'"):
        Checkpointer(tmp_path, rank=0).restore({"model": module(1), "ame": module(2)},
                                               allow_missing="ema")
