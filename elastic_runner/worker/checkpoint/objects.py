"""What a script hands save() and restore(): live objects, or finished state dicts.

Why the difference matters: objects (a module, an optimizer, the sampler) can be saved
again at any step, so the runtime registers them and saves the current step at a
resize; a finished state dict is a snapshot of one step only. The rank-0 format saves
each object's state_dict(); the sharded format needs the objects themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def holds_objects(state: Any) -> bool:
    return isinstance(state, Mapping) and any(
        callable(getattr(value, "state_dict", None)) for value in state.values())


def state_of(state: Any) -> Any:
    """Objects become their state_dict(); plain values (and finished dicts) stay."""
    if not holds_objects(state):
        return state
    return {name: value.state_dict() if callable(getattr(value, "state_dict", None)) else value
            for name, value in state.items()}
