"""What the training loop uses that `er.State` does not hold, said at a re-formation.

Why: the State keeps, rolls back and sends to new ranks only its own objects. Two
companions of the objects it holds are easy to leave out, and nothing else says so:
- the loop's ElasticSampler: new ranks (or every rank, one made anew in `train()`)
  start at the beginning of its epoch, so samples are trained twice or skipped;
- an LR scheduler of one of its optimizers: the optimizer's state carries the
  learning rate of now, but the scheduler's step count stays behind, so at its next
  step a newcomer's scheduler sets the rate of its own count (its warm-up's first
  step, say) while the others set theirs. DDP averages the gradients, every rank
  applies them with its own rate, and the replicas drift apart; a scheduler made
  anew in `train()` starts the schedule again on every rank;
- a GradScaler (mixed precision): a newcomer scales its loss by the initial scale
  while the others use theirs, and the gradients DDP averages mix the scales;
- an AveragedModel (EMA, SWA): a newcomer's average starts over, and a checkpoint
  saved from it (a newcomer may hold rank 0) keeps that.
Each is named once per process, in one warning line: a scheduler left out before the
training function's first call, the rest at the first re-formation.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("elastic_runner.worker.elastic")  # er.elastic's lines


def sampler_left_out(driving: Any, held: Any) -> str | None:
    """The warning when the loop's sampler (`driving`) is not the State's (`held`)."""
    if driving is None or driving is held:
        return None
    return ("the ElasticSampler of the training loop is not the one in er.State, so its "
            "data position is not kept through this re-formation nor sent to new ranks "
            "(samples are trained twice or skipped): make it once, before the training "
            "function, and pass it as er.State(sampler=...)")


def companions_left_out(objects: Mapping[str, Any]) -> list[str]:
    """The warnings for an LR scheduler of an optimizer of `objects`, and an enabled
    GradScaler, that live outside them. One walk of the heap (gc.get_objects): 35 ms at
    170,000 objects. By type(), not isinstance(): a lazy proxy on the heap answers
    __class__ with side effects (torch.distributed.reduce_op warns it is deprecated)."""
    from torch.amp import GradScaler
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
    from torch.optim.swa_utils import AveragedModel

    optimizers = {id(value): name for name, value in objects.items()
                  if isinstance(value, Optimizer)}
    held: set[int] = set()
    for value in objects.values():
        _hold(value, held)
    driven, scalers, averages = set(), 0, 0
    for each in gc.get_objects():
        kind = type(each)
        if id(each) in held:
            continue
        if issubclass(kind, (LRScheduler, ReduceLROnPlateau)):
            name = optimizers.get(id(getattr(each, "optimizer", None)))
            driven.update([name] if name is not None else [])
        elif issubclass(kind, GradScaler) and each.is_enabled():
            scalers += 1
        elif issubclass(kind, AveragedModel):
            averages += 1
    lines = (_scheduler_line(sorted(driven)), _scaler_line(scalers), _average_line(averages))
    return [line for line in lines if line]


def _scheduler_line(names: list[str]) -> str | None:
    which = ", ".join(repr(name) for name in names)
    return _left_out(f"an LR scheduler of er.State's optimizer {which} is", "its step count",
                     "a newcomer's learning rate differs from the others' and the replicas "
                     "drift apart; one made in the training function starts its schedule "
                     "again", "scheduler") if names else None


def _scaler_line(count: int) -> str | None:
    return _left_out(f"{count} GradScaler(s)", "the loss scale", "a newcomer scales its "
                     "loss by the initial scale while the others use theirs, and the "
                     "averaged gradients mix scales", "scaler") if count else None


def _average_line(count: int) -> str | None:
    return _left_out(f"{count} AveragedModel(s) (EMA, SWA)", "the averages", "a "
                     "newcomer's start over, and saves from a rank holding those lose them",
                     "ema") if count else None


def _left_out(what: str, kept: str, harm: str, keyword: str) -> str:
    return (f"{what} not in er.State, so {kept} is not kept through this re-formation nor "
            f"sent to new ranks ({harm}): make it once, before the training function, and "
            f"pass it as er.State({keyword}=...)")


def _hold(value: Any, held: set[int]) -> None:
    """`value` and what its state_dict() carries: the schedulers of a SequentialLR or
    ChainedScheduler, the submodules of a module (an average kept inside the model)."""
    held.add(id(value))
    for part in getattr(value, "_schedulers", None) or ():
        _hold(part, held)
    modules = getattr(value, "modules", None)
    if callable(modules) and hasattr(value, "state_dict") and hasattr(value, "_modules"):
        held.update(id(module) for module in modules())


class CoverageWarnings:
    """Each warning once per process. The heap is walked twice at most: before the
    training function's first call (a scheduler made before it is named before any
    resize) and at the first re-formation (one made inside it exists by then)."""

    def __init__(self) -> None:
        self._said: set[str] = set()
        self._walks_left = 2

    def check(self, state: Any, driving_sampler: Any) -> list[str]:
        """Log what the State misses that was not said yet; the lines logged."""
        found = [sampler_left_out(driving_sampler, state.sampler)]
        if self._walks_left > 0:
            self._walks_left -= 1
            found += companions_left_out({name: state[name] for name in state})
        new = [line for line in found if line is not None and line not in self._said]
        for line in new:
            self._said.add(line)
            log.warning("%s", line)
        return new
