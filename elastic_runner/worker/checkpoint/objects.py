"""What a script hands save() and restore(): live objects, or finished state dicts.

Why the difference matters: objects (a module, an optimizer, the sampler) can be saved
again at any step, so the runtime registers them and saves the current step at a
resize; a finished state dict is a snapshot of one step only. The rank-0 format saves
each object's state_dict(); the sharded format needs the objects themselves.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from elastic_runner.errors import CheckpointError


def holds_objects(state: Any) -> bool:
    return isinstance(state, Mapping) and any(
        callable(getattr(value, "state_dict", None)) for value in state.values())


def state_of(state: Any) -> Any:
    """Objects become their state_dict(); plain values (and finished dicts) stay."""
    if not holds_objects(state):
        return state
    return {name: value.state_dict() if callable(getattr(value, "state_dict", None)) else value
            for name, value in state.items()}


def check_names_held(where: str, step: int, held: Iterable[str], wanted: Iterable[str],
                     allow_missing: Iterable[str]) -> None:
    """Raise CheckpointError, before anything is loaded, when the checkpoint holds
    nothing for an object restore() was given.

    Why not skip it: restore() returns the step, so the script resumes at step N with
    that object as newly built. A key renamed between two launches ('model' to 'net'),
    or a folder another Checkpointer wrote, resumed with untrained weights and no word,
    and the next saves, kept `keep` at a time, deleted the trained ones. An object that
    is new in a script is named in `allow_missing`.
    """
    held, allowed = set(held), set(allow_missing)  # one name alone: Checkpointer.restore
    missing = [name for name in wanted if name not in held and name not in allowed]
    if not missing:
        return
    names = ", ".join(repr(name) for name in missing)
    holds = ", ".join(repr(name)[:60] for name in sorted(map(str, held))[:12]) or "no objects"
    raise CheckpointError(
        f"checkpoint step {step} ({where}) holds nothing for {names} (it holds {holds}): "
        f"restoring the rest would resume at step {step} with {names} as newly built. Save and "
        f"restore under the same names; if {names} is new in this script, pass "
        f"restore(objects, allow_missing=[{names}])")


def load_into(objects: Mapping[str, Any], state: Any, where: str, step: int,
              allow_missing: Iterable[str]) -> None:
    """The rank-0 format's restore: each object's load_state_dict, once every one the
    checkpoint must hold is there."""
    loadable = {name: target for name, target in objects.items()
                if callable(getattr(target, "load_state_dict", None))}
    check_names_held(where, step, state if isinstance(state, Mapping) else (), loadable,
                     allow_missing)
    for name, target in loadable.items():
        if name in state:
            target.load_state_dict(state[name])


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
