"""A script's objects as the state dict torch.distributed.checkpoint (DCP) saves and loads.

Why adapters rather than `obj.state_dict()`: DCP asks each Stateful value for its
state_dict() when saving, and when loading for a template to fill in place before
calling load_state_dict(). Modules and optimizers go through torch's state-dict
helpers (torch.distributed.checkpoint.state_dict: get/set_model_state_dict,
get/set_optimizer_state_dict): under FSDP2 they give each rank its DTensor shards,
under DDP they drop the 'module.' prefix, and they key optimizer state by parameter
name instead of position, so one checkpoint loads into another world size or wrapping.
An optimizer is paired with the module in `objects` that holds all its parameters.

Everything else (ElasticSampler, a script's own Stateful) is replicated: rank 0's
state_dict() is saved, as in the rank-0 format, so the sampler position and batch
policy travel in the same checkpoint and every rank loads the same values. Plain
values (a finished state dict, a number) are saved by every rank as they are (DCP
shards DTensors and writes each replicated value once); like the rank-0 format's
`restore`, only objects with load_state_dict() are loaded into.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from elastic_runner.errors import CheckpointError


class _ModuleState:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.module)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.module, state)


class _OptimizerState:
    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.module, self.optimizer, state)


class _Replicated:
    """A replicated object's template for loading (every rank fills it)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> Any:
        return self.obj.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.obj.load_state_dict(state)


def saving(objects: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """What this rank hands DCP to save (module docstring: who saves what)."""
    owners = _owners(objects)
    out: dict[str, Any] = {}
    for name, obj in objects.items():
        sharded = _sharded(name, obj, owners)
        if sharded is not None:
            out[name] = sharded
        elif callable(getattr(obj, "state_dict", None)):
            if rank == 0:
                out[name] = obj.state_dict()
        else:
            out[name] = obj
    return out


def loading(objects: Mapping[str, Any]) -> dict[str, Any]:
    """The templates DCP loads into: only objects that can take their state back."""
    owners = _owners(objects)
    out: dict[str, Any] = {}
    for name, obj in objects.items():
        sharded = _sharded(name, obj, owners)
        if sharded is not None:
            out[name] = sharded
        elif callable(getattr(obj, "load_state_dict", None)) and callable(
                getattr(obj, "state_dict", None)):
            out[name] = _Replicated(obj)
    return out


def _sharded(name: str, obj: Any, owners: Mapping[str, Any]) -> Any:
    """A module or optimizer, through torch's state_dict helpers; None for the rest."""
    if isinstance(obj, torch.nn.Module):
        return _ModuleState(obj)
    if isinstance(obj, torch.optim.Optimizer):
        return _OptimizerState(owners[name], obj)
    return None


def _owners(objects: Mapping[str, Any]) -> dict[str, torch.nn.Module]:
    """Optimizer name -> the module in `objects` holding all of its parameters."""
    modules = [m for m in objects.values() if isinstance(m, torch.nn.Module)]
    owners = {}
    for name, obj in objects.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        wanted = {id(p) for group in obj.param_groups for p in group["params"]}
        found = [m for m in modules if wanted <= {id(p) for p in m.parameters()}]
        if not found:
            raise CheckpointError(
                f"sharded checkpoint: optimizer {name!r} holds parameters of no single "
                "module among the objects; pass the model it optimizes in the same "
                "mapping, e.g. {'model': model, 'optim': opt}")
        owners[name] = found[0]
    return owners
