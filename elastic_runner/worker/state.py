"""`er.State`: the training state a worker keeps through an in-process re-formation.

Why a State: when the job re-forms in place (`@er.elastic`, elastic.py), the processes
that survive still hold the model, the optimizer and the data position in memory, and
a newcomer holds nothing. Reading a checkpoint would throw away every step since it
was written; a State instead knows which step its objects hold and, after every
(re-)formation, `sync()` brings every rank to the newest step any rank holds, moving
bytes only to the ranks that are behind:

- the step: the last step completed in this process (`commit`, which the runtime calls
  at every ElasticSampler step boundary; scripts without a sampler call it
  themselves), the step of the checkpoint `restore()` loaded, or the step `sync()`
  received; -1 while the objects hold nothing known (a newcomer that found no
  checkpoint). A sampler's position advances when it hands out a batch, before the
  step is done, so a step cut short by a failed collective is undone in the sampler
  (`rollback`): that step in flight is the one re-done.
- the sync: every rank all-gathers its step (a few bytes); the source is the lowest
  rank holding the highest step; the ranks behind it receive the source's state
  dicts, broadcast in a group of the source and those ranks only (tensors as raw
  bytes in bounded buckets, loaded once all arrived: state_transfer.py); a rank
  already at that step moves no bytes.

What it assumes: the objects are replicated (DDP, or no parallelism): every rank at
step s holds the same state. Sharded state (DTensor, FSDP2, a ShardedTensor) breaks
that: a lost member takes its shards with it. `check_replicated()` finds them and
raises `ShardedStateError`; `er.elastic` then keeps such a script on the restart path
(it never tells the agent it can re-form, so the agent checkpoints and restarts), and
a state that becomes sharded later fails its re-formation with that error, which the
agent answers with the restart path too. It also assumes that a rank's objects change
only in the optimizer step, after the step's last collective (the usual loop, DDP):
a rank whose collective failed mid-step then still holds the last completed step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from elastic_runner.errors import ElasticRunError
from elastic_runner.worker import state_transfer
from elastic_runner.worker.abort import group_sockets
from elastic_runner.worker.sampler import ElasticSampler
from elastic_runner.worker.step_boundary import default_group_timeout

log = logging.getLogger("elastic_runner.worker.state")

NOTHING = -1  # the step of objects that hold nothing known


class ShardedStateError(ElasticRunError):
    """The State holds sharded tensors, so it cannot be kept through a re-formation."""


@dataclass(frozen=True)
class SyncReport:
    """What the last `State.sync()` did, as this rank saw it."""

    step: int  # the step every rank holds afterwards
    source: int | None  # the rank the state came from; None when nobody was behind
    receivers: tuple[int, ...]  # the ranks that were behind
    received: int  # bytes this rank received (0 on the source and on ranks up to date)
    seconds: float = 0.0  # how long the sync took here, the step comparison included


def plan_transfer(steps: list[int]) -> tuple[int, tuple[int, ...]]:
    """(source, ranks behind) for the step each rank holds: the source is the lowest
    rank holding the highest step; every rank below that step is behind."""
    newest = max(steps)
    source = steps.index(newest)
    return source, tuple(rank for rank, step in enumerate(steps) if step < newest)


class State(Mapping):
    """Named objects with state_dict()/load_state_dict() that a worker keeps in place.

    A read-only mapping of name -> object, so it can be passed wherever the objects
    are (`ckpt.save(step, state)` registers them for resizes); names are also
    attributes (`state.model`).
    """

    def __init__(self, **objects: Any):
        if not objects:
            raise TypeError("er.State needs at least one object, e.g. State(model=model)")
        for name, value in objects.items():
            if not (callable(getattr(value, "state_dict", None))
                    and callable(getattr(value, "load_state_dict", None))):
                raise TypeError(f"er.State: {name}={type(value).__name__} has no "
                                "state_dict()/load_state_dict(); pass modules, optimizers, "
                                "samplers or your own objects that have both")
        self._objects = dict(objects)
        samplers = [value for value in objects.values() if isinstance(value, ElasticSampler)]
        self._sampler = samplers[0] if samplers else None
        self._step = NOTHING
        self._mark: dict | None = None  # the sampler's position at `_step`
        self._remember_position()
        self.last_sync: SyncReport | None = None

    # ---- the mapping ---------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self._objects[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._objects)

    def __len__(self) -> int:
        return len(self._objects)

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"er.State has no object named {name!r}")

    # ---- the step ------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The last step these objects completed (-1: nothing known yet)."""
        return self._step

    @property
    def sampler(self) -> ElasticSampler | None:
        return self._sampler

    def commit(self, step: int | None = None) -> None:
        """Step `step` is complete (default: the one after the last). The runtime
        calls this at every ElasticSampler boundary; other scripts call it once per
        step, after the optimizer step, and it is then their step boundary: a pause
        or a notice every rank agreed on is acted on here (under `@er.elastic` it
        leaves the loop to re-form, as the sampler's boundary does)."""
        self.completed(step)
        if self._sampler is None:
            from elastic_runner.worker import runtime  # it does not import this module

            runtime.at_step_boundary(self._step, 0)

    def completed(self, step: int | None = None) -> None:
        """Record that step `step` is complete, and nothing more: what the sampler's
        boundary tells the State (it does the agreeing itself)."""
        self._step = step if step is not None else max(self._step, 0) + 1
        self._remember_position()

    def rollback(self) -> None:
        """Undo a step cut short (a collective failed mid-step): the sampler goes back
        to the position of the last completed step, so that step is handed out again."""
        if self._sampler is not None and self._mark is not None \
                and self._sampler.state_dict() != self._mark:
            log.info("re-doing step %d: the sampler goes back to step %d",
                     self._sampler.step, self._mark["step"])
            self._sampler.load_state_dict(self._mark)

    def _remember_position(self) -> None:
        if self._sampler is not None:
            self._mark = self._sampler.state_dict()

    # ---- checkpoints ---------------------------------------------------------------
    def restore(self, ckpt, allow_missing: Iterable[str] = ()) -> int | None:
        """Load the newest verified checkpoint of `ckpt` (an er.Checkpointer) into the
        objects, register them for resizes, and return its step (None: there is none,
        and the objects keep what they hold). `allow_missing`: names of objects new in
        this script, which the checkpoint may lack (Checkpointer.restore)."""
        loaded = ckpt.restore(self._objects, allow_missing)
        if loaded is not None:
            self._step = loaded
            self._remember_position()
        return loaded

    # ---- keeping the state through a re-formation ----------------------------------------
    def check_replicated(self) -> None:
        """Raise ShardedStateError if any object's state holds a sharded tensor."""
        sharded = _sharded_types()
        if not sharded:
            return
        for name, value in self._objects.items():
            where = _find_sharded(value.state_dict(), sharded, name)
            if where is not None:
                raise ShardedStateError(
                    f"er.State holds a sharded tensor ({where}): its shards are not "
                    "replicated on other ranks, so the job cannot re-form in place when "
                    "a member is lost; the launcher restarts the workers from the last "
                    "checkpoint instead. Keep the state replicated (DDP) to re-form in place.")

    def sync(self, group: Any = None) -> int:
        """Bring every rank of the job to the newest step any rank holds (every rank of
        the default process group calls it, after each (re-)formation).

        Returns the bytes this rank received (0 on the source and on every rank that
        was up to date): summed over the ranks, the bytes the sync moved.

        Raises:
            ShardedStateError: the state holds sharded tensors (see check_replicated).
            RuntimeError: a collective failed (a peer died); er.elastic re-forms again.
        """
        import torch.distributed as dist

        if group not in (None, getattr(dist.group, "WORLD", None)):
            raise ValueError("State.sync() runs on the default process group only")
        started = time.monotonic()
        self.last_sync = SyncReport(self._step, None, (), 0)
        if not (dist.is_available() and dist.is_initialized()):
            return 0
        self.check_replicated()
        if dist.get_world_size() == 1:
            return 0
        steps = _all_gather_steps(self._step)
        source, behind = plan_transfer(steps)
        received = self._transfer(source, behind) if behind else 0
        self.last_sync = SyncReport(self._step, source if behind else None, behind, received,
                                    time.monotonic() - started)
        if received:
            log.info("received the state of step %d from rank %d (%d bytes)",
                     self._step, source, received)
        return received

    def _transfer(self, source: int, behind: tuple[int, ...]) -> int:
        """Send the source's state to the ranks behind (state_transfer.py); bytes
        received here."""
        import torch.distributed as dist

        # Every rank creates the group, members or not: torch requires it. Its
        # connections are kept with the round's (abort.group_sockets), so that a
        # broken round's cut reaches a transfer blocked on a lost or frozen peer, and
        # it times out with the round's group, not after torch's 30 minutes.
        with group_sockets.capture():
            group = dist.new_group(sorted((source, *behind)), timeout=default_group_timeout())
        rank = dist.get_rank()
        if rank != source and rank not in behind:
            return 0
        try:
            if rank == source:
                state_transfer.send(self._states(), source, group, _device())
                return 0
            states, received = state_transfer.receive(source, group, _device())
        finally:
            dist.destroy_process_group(group)
        self._load(states)
        return received

    def _states(self) -> dict[str, Any]:
        return {"step": self._step,
                "objects": {name: value.state_dict() for name, value in self._objects.items()}}

    def _load(self, states: dict[str, Any]) -> None:
        """Load received state dicts: each object moves them to its own device."""
        for name, value in self._objects.items():
            value.load_state_dict(states["objects"][name])
        self._step = int(states["step"])
        self._remember_position()


def _device():
    """Where collective tensors live: the default group's backend decides."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_steps(step: int) -> list[int]:
    import torch
    import torch.distributed as dist

    mine = torch.tensor([step], dtype=torch.int64, device=_device())
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [int(value.item()) for value in everyone]


def _sharded_types() -> tuple[type, ...]:
    found = []
    try:
        from torch.distributed.tensor import DTensor
        found.append(DTensor)
    except ImportError:
        pass
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
        found.append(ShardedTensor)
    except ImportError:
        pass
    return tuple(found)


def _find_sharded(value: Any, sharded: tuple[type, ...], path: str) -> str | None:
    """The path of the first sharded tensor in a (nested) state dict, or None."""
    if isinstance(value, sharded):
        return path
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        where = _find_sharded(item, sharded, f"{path}.{key}")
        if where is not None:
            return where
    return None
