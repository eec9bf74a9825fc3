"""What the training loop uses that er.State does not hold, named at the first
re-formation (worker/state_coverage.py): an LR scheduler of the State's optimizer left
out of it, and the loop's sampler (test_ddp_before_training.py has the Reformer side)."""

from __future__ import annotations

import logging

import torch
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau, SequentialLR, StepLR

import elastic_runner as er
from elastic_runner.worker.state_coverage import CoverageWarnings, companions_left_out


def model_and_optimizer():
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def schedulers_left_out(objects):
    """The scheduler line, or None (no GradScaler lives in these tests)."""
    lines = [line for line in companions_left_out(objects) if "LR scheduler" in line]
    return lines[0] if lines else None


def test_a_scheduler_of_the_states_optimizer_left_out_is_named():
    model, optimizer = model_and_optimizer()
    schedule = LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 100))  # a warm-up
    line = schedulers_left_out({"model": model, "optim": optimizer})
    assert "optimizer 'optim' is not in er.State" in line
    assert "er.State(scheduler=...)" in line
    assert schedulers_left_out({"model": model, "optim": optimizer, "sched": schedule}) is None


def test_schedulers_of_other_optimizers_or_none_at_all_are_not_named():
    model, optimizer = model_and_optimizer()
    _, other = model_and_optimizer()
    other_schedule = StepLR(other, step_size=5)
    assert schedulers_left_out({"model": model, "optim": optimizer}) is None
    assert "'other'" in schedulers_left_out({"model": model, "other": other})
    assert schedulers_left_out({"model": model}) is None
    del other_schedule


def test_a_plateau_scheduler_and_a_sequence_of_schedulers_count_too():
    model, optimizer = model_and_optimizer()
    plateau = ReduceLROnPlateau(optimizer)
    assert "'optim'" in schedulers_left_out({"model": model, "optim": optimizer})
    assert plateau.optimizer is optimizer
    assert schedulers_left_out({"optim": optimizer, "plateau": plateau}) is None
    model, optimizer = model_and_optimizer()
    warm = LambdaLR(optimizer, lambda step: 1.0)
    decay = StepLR(optimizer, step_size=10)
    sequence = SequentialLR(optimizer, [warm, decay], milestones=[5])
    # The sequence's state_dict() carries its parts': holding it holds them.
    assert schedulers_left_out({"optim": optimizer, "sched": sequence}) is None
    assert "'optim'" in schedulers_left_out({"optim": optimizer, "warm": warm})


def test_each_line_once_per_process(caplog):
    model, optimizer = model_and_optimizer()
    schedule = StepLR(optimizer, step_size=5)  # a scheduler no one holds is gone at once
    outside, kept = (er.ElasticSampler(8, global_batch_size=2) for _ in range(2))
    state = er.State(model=model, optimizer=optimizer, sampler=kept)
    warnings = CoverageWarnings()
    with caplog.at_level(logging.WARNING, logger="elastic_runner.worker.elastic"):
        assert len(warnings.check(state, outside)) == 2  # before the first call
        late = er.State(model=model, adam=torch.optim.Adam(model.parameters()))
        made_later = StepLR(late.adam, step_size=5)  # as in the training function
        assert len(warnings.check(late, outside)) == 1  # the first re-formation's walk
        assert warnings.check(state, outside) == []
    assert len(caplog.records) == 3
    assert schedule.last_epoch == made_later.last_epoch == 0


def test_an_enabled_grad_scaler_left_out_is_named_and_one_held_or_disabled_is_not():
    model, optimizer = model_and_optimizer()
    scaler = torch.amp.GradScaler("cpu")
    (line,) = companions_left_out({"model": model, "optim": optimizer})
    assert line.startswith("1 GradScaler(s) not in er.State") and "er.State(scaler=...)" in line
    assert companions_left_out({"model": model, "optim": optimizer, "scaler": scaler}) == []
    del scaler
    off = torch.amp.GradScaler("cpu", enabled=False)  # full precision: nothing to keep
    assert companions_left_out({"model": model, "optim": optimizer}) == []
    assert not off.is_enabled()


def test_an_averaged_model_left_out_is_named_and_one_held_or_inside_the_model_is_not():
    from torch.optim.swa_utils import AveragedModel

    model, optimizer = model_and_optimizer()
    ema = AveragedModel(model)
    (line,) = companions_left_out({"model": model, "optim": optimizer})
    assert line.startswith("1 AveragedModel(s) (EMA, SWA) not in er.State")
    assert companions_left_out({"model": model, "optim": optimizer, "ema": ema}) == []
    holder = torch.nn.ModuleDict({"net": model, "ema": ema})  # kept inside what is held
    assert companions_left_out({"model": holder, "optim": optimizer}) == []
