"""A sampler whose checkpoints survive a change of world size.

Under elastic-run the number of ranks changes between restarts. A sampler that
keeps a per-rank position (like torch's DistributedSampler) cannot be resumed
by a different number of ranks without repeating or skipping samples, which
changes what the model learns. This sampler keeps one *global* position
instead, the number of samples of the epoch's permutation that all ranks
together have consumed, and derives each rank's indices from it. Any world
can continue from that position, so across any sequence of resizes every
index of an epoch is handed out exactly once.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from elastic_runner.errors import SamplerDrawnAhead
from elastic_runner.worker.scaling import BatchPlan, BatchPolicy, parse_policy, plan_batch

STATE_VERSION = 1
DEFAULT_GLOBAL_BATCH = 64
_STATE_KEYS = ("version", "epoch", "step", "samples_consumed", "seed",
               "num_samples", "global_batch_size", "shuffle", "drop_last",
               "policy")
# Must match between checkpoint and sampler, or the permutation differs and a
# resume would repeat or skip samples.
_IDENTITY_KEYS = ("num_samples", "seed", "shuffle")


def epoch_permutation(num_samples: int, seed: int, epoch: int,
                      shuffle: bool = True) -> list[int]:
    """The order in which an epoch visits the dataset.

    It depends only on (num_samples, seed, epoch, shuffle), never on the rank or
    world size, so every rank of every restart agrees on it. Python's own
    ``random.Random`` is used because its integer seeding and ``shuffle`` are
    stable across processes, platforms and versions and need no torch.
    """
    order = list(range(num_samples))
    if shuffle:
        # seed * 2**64 + epoch keeps (seed, epoch) pairs from colliding, which
        # seed + epoch would not (seed 1/epoch 0 == seed 0/epoch 1).
        random.Random(seed * 2**64 + epoch).shuffle(order)
    return order


class ElasticSampler:
    """Hands each rank its share of every global batch, resumable at any world.

    Position: ``samples_consumed`` counts samples of the epoch's permutation
    consumed by all ranks together. Global step ``s`` takes the next
    ``global_batch`` indices from there; this rank gets the contiguous slice
    ``[offset, offset + share)`` of it given by ``batch_plan``. When the global
    batch does not divide by the world size, the lowest ranks get one sample
    more (see :func:`elastic_runner.worker.scaling.split_evenly`).

    Checkpoints: the position advances when a batch is *yielded*, before the
    loop body runs, so a ``state_dict()`` taken inside the body after training
    on step ``s`` already counts that batch, and a resume yields step ``s + 1``
    with the next samples. Steps are global optimizer steps, start at 1 and go
    on increasing across epochs; ``step == 0`` means none taken yet.

    Epochs: one ``for`` loop runs the rest of the current epoch and then ends;
    iterating again yields nothing until ``set_epoch`` moves to another epoch,
    which restarts the position at 0. ``set_epoch`` with the current epoch keeps
    the position, so a resumed job can run the usual loop unchanged::

        sampler.load_state_dict(ckpt["sampler"])
        for epoch in range(sampler.epoch, num_epochs):
            sampler.set_epoch(epoch)
            for step, indices in sampler:
                ...

    Last batch: with ``drop_last=False`` the final global batch holds what is
    left and is split as evenly as possible, so ranks get an empty list when
    fewer samples than ranks are left (under DDP, every rank must still run a
    forward/backward, e.g. with a zero loss). With ``drop_last=True`` only that
    final partial batch is skipped.

    Policy: ``global_batch_size`` is the size for the default
    ``constant-global`` policy and for a policy given as a string. Under
    ``constant-local`` the global batch grows with the world, and
    ``global_batch_size`` means the per-rank batch (the global batch at world
    size 1). A :class:`BatchPolicy` object carries its own size, and passing a
    different ``global_batch_size`` with it is an error.

    Memory: the epoch's permutation is held as a Python list (about 36 bytes
    per sample); it is built once per epoch.
    """

    def __init__(self, num_samples: int, global_batch_size: int | None = None,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 policy: BatchPolicy | str | None = None, rank: int | None = None,
                 world_size: int | None = None) -> None:
        """Build the sampler for this restart's world.

        Args:
            num_samples: dataset length; must match any checkpoint loaded.
            global_batch_size: see "Policy" above; 64 when not given.
            seed: base of the shuffle; must match any checkpoint loaded.
            shuffle: False visits 0..num_samples-1 in order.
            drop_last: skip the final partial global batch of each epoch.
            policy: a BatchPolicy, a policy string, or None (constant-global).
            rank, world_size: default to torch.distributed when initialized,
                else 0 and 1.

        Raises:
            ValueError: for bad sizes, or a policy that does not fit the world
                (BatchPolicyError, e.g. a global batch below the world size).
        """
        _check_int("num_samples", num_samples, minimum=1)
        _check_int("seed", seed, minimum=0)
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(flag, bool):  # "False" from a config file is true
                raise ValueError(f"{name} must be True or False; got {flag!r}")
        self._num_samples = num_samples
        self._seed = seed
        self._shuffle = bool(shuffle)
        self._drop_last = bool(drop_last)
        self._policy = _resolve_policy(policy, global_batch_size)
        # Built in a process group without a rank or world size given, the sampler
        # follows that group, which an in-process re-formation (er.elastic) replaces:
        # see _follow_world. So does one built by a worker on standby, whose group
        # comes later (reform.py). Built outside any group, it keeps the world it was given.
        self._follows_group = (rank is None or world_size is None) and (
            _torch_rank_world(alone=(None, None))[0] is not None or _on_standby())
        self._given = (rank, world_size)
        rank, world_size = _resolve_world(rank, world_size)
        self._plan = plan_batch(self._policy, world_size, rank)
        self._epoch = 0
        self._step = 0
        self._consumed = 0
        self._perm: tuple[int, list[int]] | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step(self) -> int:
        """The last global step handed out (0 before the first)."""
        return self._step

    @property
    def samples_consumed(self) -> int:
        """Samples of this epoch consumed by all ranks together."""
        return self._consumed

    @property
    def remaining(self) -> int:
        """Samples of this epoch not yet handed out (drop_last may skip some)."""
        return self._num_samples - self._consumed

    @property
    def batch_plan(self) -> BatchPlan:
        self._follow_world()
        return self._plan

    @property
    def policy(self) -> BatchPolicy:
        return self._policy

    @property
    def num_samples(self) -> int:
        return self._num_samples

    def __len__(self) -> int:
        """Steps left in this epoch for the current world."""
        self._follow_world()
        full, partial = divmod(self.remaining, self._plan.global_batch)
        return full if self._drop_last or partial == 0 else full + 1

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        _refuse_drawing_ahead()
        self._follow_world()  # a re-formed group: the same position, split anew
        _boundaries_from_here(self)
        epoch = self._epoch
        # Re-read the state every step so load_state_dict/set_epoch called
        # during the loop take effect; a new epoch ends this loop.
        while self._epoch == epoch:
            batch_len = self._next_batch_len()
            if batch_len == 0:
                return
            step, indices = self._take(batch_len)
            yield step, indices
            _step_boundary(step, len(indices))

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch``; the position restarts at 0 only if it changes."""
        _check_int("epoch", epoch, minimum=0)
        if epoch != self._epoch:
            self._epoch = epoch
            self._consumed = 0

    def state_dict(self) -> dict[str, Any]:
        """Plain ints/strings/bools, safe for any checkpoint format.

        ``global_batch_size`` and ``policy`` record the batch in effect when
        saving; they are informational, since a resume may use another world or
        policy.
        """
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "step": self._step,
            "samples_consumed": self._consumed,
            "seed": self._seed,
            "num_samples": self._num_samples,
            "global_batch_size": self._plan.global_batch,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
            "policy": self._policy.spec,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint, possibly saved by another world size.

        Only the position (epoch, step, samples_consumed) is taken over. This
        sampler keeps its own policy and drop_last, which may differ from the
        saved ones: the position is counted in samples, so it stays valid.

        Raises:
            ValueError: if the state is not a version-1 sampler state, or was
                saved for another dataset, seed or shuffle setting.
        """
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"not an ElasticSampler state: missing {missing}")
        if state["version"] != STATE_VERSION:
            raise ValueError(f"sampler state version {state['version']!r} is not "
                             f"supported; this code reads version {STATE_VERSION}")
        self._check_same_data(state)
        _check_int("epoch", state["epoch"], minimum=0)
        _check_int("step", state["step"], minimum=0)
        _check_int("samples_consumed", state["samples_consumed"], minimum=0,
                   maximum=self._num_samples)
        self._epoch = state["epoch"]
        self._step = state["step"]
        self._consumed = state["samples_consumed"]

    def _check_same_data(self, state: Mapping[str, Any]) -> None:
        for key in _IDENTITY_KEYS:
            saved, ours = state[key], getattr(self, f"_{key}")
            if saved != ours:
                raise ValueError(
                    f"checkpoint sampler state has {key}={saved!r} but this "
                    f"sampler has {key}={ours!r}: it was saved for a different "
                    f"dataset or sample order, and resuming from it would "
                    f"repeat or skip samples. Load the matching checkpoint or "
                    f"start a new run.")

    def _follow_world(self) -> None:
        """Re-plan for the process group of now, if it changed since the last plan.

        Why: under `er.elastic` this process lives on through a resize and iterates
        again in the new group. The position is a global sample count, so a new split
        of the next global batch is all a new world needs (as on resuming a checkpoint
        saved at another world size): no sample is repeated or skipped. Only while a
        group is up: after it is left, the last plan stands."""
        if not self._follows_group:
            return
        group_rank, group_world = _torch_rank_world(alone=(None, None))
        if group_rank is None:
            return
        rank, world_size = _resolve_world(*self._given, found=(group_rank, group_world))
        if (rank, world_size) != (self._plan.rank, self._plan.world_size):
            self._plan = plan_batch(self._policy, world_size, rank)

    def _next_batch_len(self) -> int:
        return self._batch_len_at(self._consumed, self._plan)

    def _batch_len_at(self, consumed: int, plan: BatchPlan) -> int:
        left = self._num_samples - consumed
        if left >= plan.global_batch:
            return plan.global_batch
        return 0 if self._drop_last else left

    def _take(self, batch_len: int) -> tuple[int, list[int]]:
        indices = self._share_at(self._epoch, self._consumed, batch_len, self._plan)
        self._consumed += batch_len
        self._step += 1
        return self._step, indices

    def _share_at(self, epoch: int, consumed: int, batch_len: int,
                  plan: BatchPlan) -> list[int]:
        offset, length = plan.rank_slice(batch_len)
        start = consumed + offset
        return self._permutation(epoch)[start:start + length]

    def _batches_ahead(self) -> Iterator[PlannedBatch]:
        """The rest of this epoch from the current position, without moving it: what a
        loader with worker processes loads ahead (data_loader.py). Each batch records
        where the sampler must stand for it to be the next step (`_commit`)."""
        epoch, consumed, plan = self._epoch, self._consumed, self._plan
        while (length := self._batch_len_at(consumed, plan)) > 0:
            yield PlannedBatch(epoch, consumed, length, plan,
                               self._share_at(epoch, consumed, length, plan))
            consumed += length

    def _commit(self, planned: PlannedBatch) -> int | None:
        """Take a batch drawn ahead as the next step; None when the position moved since
        it was drawn (load_state_dict, set_epoch, a new world), which makes it stale."""
        if (planned.epoch, planned.consumed, planned.plan) != (
                self._epoch, self._consumed, self._plan):
            return None
        self._consumed += planned.length
        self._step += 1
        return self._step

    def _permutation(self, epoch: int | None = None) -> list[int]:
        epoch = self._epoch if epoch is None else epoch
        if self._perm is None or self._perm[0] != epoch:
            order = epoch_permutation(self._num_samples, self._seed, epoch, self._shuffle)
            self._perm = (epoch, order)
        return self._perm[1]


@dataclass(frozen=True)
class PlannedBatch:
    """One step's batch drawn ahead of the loop: this rank's indices, and the position
    (epoch, samples consumed before it, the world's plan) it was drawn from."""

    epoch: int
    consumed: int
    length: int  # samples of the global batch, all ranks together
    plan: BatchPlan
    indices: list[int]


def _refuse_drawing_ahead() -> None:
    """Refuse a loop that takes batches before it trains them.

    Why: the position advances when a batch is handed out, and is what checkpoints
    save and resizes agree on. A torch DataLoader with worker processes draws
    prefetch_factor x num_workers batches ahead (its iterator's `_reset` fills the
    queue through `_try_put_index` -> `_next_index`), so a checkpoint then counts
    batches not yet trained, and a resume skipped them: 128 of 640 samples with 2
    workers, measured. A sampler iterated inside a worker process advances a copy the
    checkpoint never sees. Both were silent; er.ElasticDataLoader loads ahead and
    counts only what reached the loop.
    """
    data = sys.modules.get("torch.utils.data")
    if data is None:
        return
    if data.get_worker_info() is not None:
        raise SamplerDrawnAhead(
            "an ElasticSampler is iterated inside a DataLoader worker process: its "
            "position there is a copy that checkpoints and resizes never see, so a resume "
            "repeats every sample; iterate it in the training loop, or load through "
            "er.ElasticDataLoader(dataset, sampler, num_workers=...)")
    try:
        frame = sys._getframe(2)  # the caller of the generator's next()
    except ValueError:  # no Python frame called it
        return
    for _ in range(4):
        if frame is None:
            return
        loader = frame.f_locals.get("self") if frame.f_code.co_name == "_next_index" else None
        if getattr(loader, "_num_workers", 0) > 0:
            raise SamplerDrawnAhead(
                f"an ElasticSampler drives a DataLoader with {loader._num_workers} worker "
                f"processes, which draws batches ahead of training: checkpoints would "
                f"count batches not yet trained and a resume would skip them; use "
                f"er.ElasticDataLoader(dataset, sampler, num_workers=...) instead")
        frame = frame.f_back


def _boundaries_from_here(sampler: "ElasticSampler") -> None:
    """This loop will report every step's end: tell the runtime before the first step.

    Why: until a round's first boundary, Checkpointer.due() cannot tell a script with
    a sampler from one without, and one without agrees on stops in due() itself, the
    restart path's way. A peer's spot notice in a round's first step (just after an
    in-process re-formation) then stopped every worker with a checkpoint instead of
    re-forming in place (seen in a chaos soak: three nodes restarted, 14 s without a step).
    """
    runtime = sys.modules.get("elastic_runner.worker.runtime")
    if runtime is not None:
        runtime.sampler_drives_boundaries(sampler)


def _step_boundary(step: int, samples: int) -> None:
    """The body of `step` is done: the runtime may stop here for a resize.

    Through sys.modules so that this module never imports the runtime (or torch):
    without er.init() there is no runtime, and nothing to do.
    """
    runtime = sys.modules.get("elastic_runner.worker.runtime")
    if runtime is not None:
        runtime.at_step_boundary(step, samples)


def _resolve_policy(policy: BatchPolicy | str | None,
                    batch_size: int | None) -> BatchPolicy:
    if isinstance(policy, BatchPolicy):
        if batch_size is not None and batch_size != policy.batch_size:
            raise ValueError(
                f"global_batch_size={batch_size} conflicts with the policy's "
                f"batch size {policy.batch_size}; pass only one of them")
        return policy
    size = DEFAULT_GLOBAL_BATCH if batch_size is None else batch_size
    if policy is None:
        return BatchPolicy.constant_global(size)
    if isinstance(policy, str):
        return parse_policy(policy, size)
    raise TypeError(f"policy must be a BatchPolicy, a string or None; "
                    f"got {type(policy).__name__}")


def _resolve_world(rank: int | None, world_size: int | None,
                   found: tuple[int, int] | None = None) -> tuple[int, int]:
    """(rank, world_size), filling gaps from torch.distributed if it is up (or `found`)."""
    if rank is None or world_size is None:
        dist_rank, dist_world = found or _torch_rank_world()
        rank = dist_rank if rank is None else rank
        world_size = dist_world if world_size is None else world_size
    return rank, world_size


def _on_standby() -> bool:
    """This worker has no place yet: er.elastic gives it one, and a group with it."""
    from elastic_runner.reform import STANDBY_ROUND
    from elastic_runner.worker import runtime

    context = runtime.current()
    return context is not None and context.round == STANDBY_ROUND


def _torch_rank_world(alone: tuple[int, int] | tuple[None, None] = (0, 1)):
    """(rank, world_size) of the process group if one is up, else `alone`."""
    # Imported here so this module loads without torch, and is cheap to use
    # in tools that never touch a process group.
    try:
        import torch.distributed as dist
    except ImportError:
        return alone
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return alone


def _check_int(name: str, value: Any, minimum: int,
               maximum: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or value < minimum or (maximum is not None and value > maximum):
        bound = f" and at most {maximum}" if maximum is not None else ""
        raise ValueError(f"{name} must be an integer of at least {minimum}"
                         f"{bound}; got {value!r}")
