"""What a script hands save() and restore(): live objects, or finished state dicts.

Why the difference matters: objects (a module, an optimizer, the sampler) can be saved
again at any step, so the runtime registers them and saves the current step at a
resize; a finished state dict is a snapshot of one step only. The rank-0 format saves
each object's state_dict(); the sharded format needs the objects themselves.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch


def holds_objects(state: Any) -> bool:
    return isinstance(state, Mapping) and any(
        callable(getattr(value, "state_dict", None)) for value in state.values())


def state_of(state: Any) -> Any:
    """Objects become their state_dict(); plain values (and finished dicts) stay."""
    if not holds_objects(state):
        return state
    return {name: value.state_dict() if callable(getattr(value, "state_dict", None)) else value
            for name, value in state.items()}


def check_save_arguments(step: Any, objects: Any) -> None:
    """A sharded save takes the live objects: what it needs, said in one line."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if not isinstance(objects, Mapping):
        raise TypeError("a sharded save takes a mapping of name -> object, e.g. "
                        f"{{'model': model, 'optim': opt}}, not {type(objects).__name__}")


def snapshot(obj: Any, memo: dict[int, torch.Tensor]) -> Any:
    """CPU copy made in the caller's thread so training may mutate right after."""
    # memo: a tensor that appears twice (tied weights) stays shared in the copy.
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = obj.detach().to("cpu", copy=True)
        return memo[id(obj)]
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, snapshot(v, memo)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(snapshot(v, memo) for v in obj)
    return copy.deepcopy(obj)
