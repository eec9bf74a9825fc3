"""Batch policies: how the batch and the learning rate follow the world size.

An elastic job restarts with a different number of ranks. Something has to
decide what stays fixed across a resize, and that choice changes what the model
learns, so it is made explicit here instead of being left to each training
script:

* ``constant-global`` keeps the global batch ``G`` fixed. The optimizer sees the
  same batch whatever the world size, so the learning rate needs no change
  (factor 1.0). Each rank gets ``G // world`` samples and the ``G % world``
  left over go one each to the lowest ranks, so shares differ by at most one
  and no sample is dropped. If a share is more than ``max_per_rank`` (what
  fits in memory), it is split into micro-batches for gradient accumulation.
* ``constant-local`` keeps the per-rank batch ``B`` fixed, so the global batch
  is ``B * world`` and grows with the world. The learning rate then follows the
  ``linear`` rule (``world / base_world_size``) or the ``sqrt`` rule
  (``sqrt(world / base_world_size)``).

Everything here is pure: a plan depends only on (policy, world size, rank), so
every rank computes the same plan without talking to the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from elastic_runner.errors import ConfigError

CONSTANT_GLOBAL = "constant-global"
CONSTANT_LOCAL = "constant-local"
LR_RULES = ("linear", "sqrt")
ACCEPTED_POLICIES = (
    CONSTANT_GLOBAL,
    CONSTANT_LOCAL,
    f"{CONSTANT_LOCAL}:linear",
    f"{CONSTANT_LOCAL}:sqrt",
)


class BatchPolicyError(ConfigError, ValueError):
    """A batch policy that cannot be applied to the requested world.

    It is a ValueError for library callers and a ConfigError so that the CLI
    reports it as a bad flag (exit 2) rather than as an internal error.
    """


def split_evenly(total: int, parts: int) -> tuple[int, ...]:
    """Split ``total`` into ``parts`` sizes that differ by at most one.

    The extra units go to the lowest indices, so rank 0 is never short; this
    is the one rule used for rank shares, micro-batches and the last batch of
    an epoch, so they all agree.

    Raises:
        BatchPolicyError: if ``parts`` < 1 or ``total`` < 0.
    """
    if parts < 1:
        raise BatchPolicyError(f"cannot split into {parts} parts; need at least 1")
    if total < 0:
        raise BatchPolicyError(f"cannot split a negative size ({total})")
    base, extra = divmod(total, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


@dataclass(frozen=True)
class BatchPolicy:
    """What stays fixed when the world size changes.

    Build it with :meth:`constant_global`, :meth:`constant_local` or
    :func:`parse_policy` rather than directly, so the fields always make sense
    together.

    Attributes:
        name: ``constant-global`` or ``constant-local``.
        batch_size: the global batch (constant-global) or the per-rank batch
            (constant-local).
        lr_rule: ``linear``/``sqrt`` for constant-local; None for
            constant-global, whose learning rate never changes.
        base_world_size: the world size the learning rate was tuned for.
        max_per_rank: largest micro-batch one rank can run; None for no cap.
    """

    name: str
    batch_size: int
    lr_rule: str | None = None
    base_world_size: int = 1
    max_per_rank: int | None = None

    def __post_init__(self) -> None:
        if self.name not in (CONSTANT_GLOBAL, CONSTANT_LOCAL):
            raise BatchPolicyError(_unknown_policy_message(self.name))
        _check_positive("batch_size", self.batch_size)
        _check_positive("base_world_size", self.base_world_size)
        if self.max_per_rank is not None:
            _check_positive("max_per_rank", self.max_per_rank)
        if self.name == CONSTANT_GLOBAL and self.lr_rule is not None:
            raise BatchPolicyError(
                f"{CONSTANT_GLOBAL} keeps the learning rate fixed; "
                f"got lr_rule={self.lr_rule!r}")
        if self.name == CONSTANT_LOCAL and self.lr_rule not in LR_RULES:
            raise BatchPolicyError(
                f"lr_rule must be one of {', '.join(LR_RULES)}; got {self.lr_rule!r}")

    @classmethod
    def constant_global(cls, global_batch: int,
                        max_per_rank: int | None = None) -> BatchPolicy:
        """Fix the global batch; the learning rate stays as tuned."""
        return cls(CONSTANT_GLOBAL, global_batch, None, 1, max_per_rank)

    @classmethod
    def constant_local(cls, per_rank_batch: int, lr_rule: str = "linear",
                       base_world_size: int = 1,
                       max_per_rank: int | None = None) -> BatchPolicy:
        """Fix the per-rank batch; scale the learning rate with the world."""
        return cls(CONSTANT_LOCAL, per_rank_batch, lr_rule, base_world_size,
                   max_per_rank)

    @property
    def spec(self) -> str:
        """The text :func:`parse_policy` turns back into this kind of policy."""
        if self.name == CONSTANT_LOCAL:
            return f"{CONSTANT_LOCAL}:{self.lr_rule}"
        return CONSTANT_GLOBAL


@dataclass(frozen=True)
class BatchPlan:
    """One rank's part of one global step, for one world size.

    Attributes:
        policy: the policy spec, e.g. ``constant-local:sqrt``.
        world_size: number of ranks the plan is for.
        rank: the rank this plan belongs to.
        global_batch: samples consumed by one optimizer step, all ranks together.
        shares: every rank's share, in rank order; they sum to global_batch.
        offset: where this rank's share starts inside the global batch.
        accum_steps: micro-batches per optimizer step. It is the same on every
            rank (taken from the largest share) so that all ranks run the same
            number of forward/backward passes, which DDP needs.
        micro_batch_sizes: this rank's share split into accum_steps parts.
        lr_factor: multiply the tuned learning rate by this.
    """

    policy: str
    world_size: int
    rank: int
    global_batch: int
    shares: tuple[int, ...]
    offset: int
    accum_steps: int
    micro_batch_sizes: tuple[int, ...]
    lr_factor: float

    @property
    def share(self) -> int:
        """This rank's number of samples in a full global batch."""
        return self.shares[self.rank]

    def rank_slice(self, batch_len: int) -> tuple[int, int]:
        """(offset, length) of this rank's part of a global batch of ``batch_len``.

        A full batch uses the plan's shares; the shorter last batch of an epoch
        is split with the same rule, so some ranks get nothing when
        ``batch_len < world_size``.
        """
        if batch_len == self.global_batch:
            return self.offset, self.share
        sizes = split_evenly(batch_len, self.world_size)
        return sum(sizes[:self.rank]), sizes[self.rank]

    def micro_batches(self, indices: Sequence[int]) -> list[list[int]]:
        """Split this rank's indices into ``accum_steps`` contiguous micro-batches.

        Always ``accum_steps`` lists, so every rank runs the same number of
        backward passes; a list is empty only in a short final batch.
        """
        sizes = split_evenly(len(indices), self.accum_steps)
        out: list[list[int]] = []
        start = 0
        for size in sizes:
            out.append(list(indices[start:start + size]))
            start += size
        return out

    def describe(self) -> str:
        """One line for the launcher log at every resize."""
        text = (f"{self.policy}: global {self.global_batch} = "
                f"{_format_shares(self.shares)} over {self.world_size} "
                f"rank{'s' if self.world_size != 1 else ''}")
        if self.accum_steps > 1:
            text += (f", accum {self.accum_steps} x "
                     f"<={max(self.micro_batch_sizes)}")
        return text + f", lr x{self.lr_factor:.2f}"

    def __str__(self) -> str:
        return self.describe()


def plan_batch(policy: BatchPolicy, world_size: int, rank: int = 0) -> BatchPlan:
    """Work out ``rank``'s share of the global batch for ``world_size`` ranks.

    Raises:
        BatchPolicyError: if the world or rank is invalid, or a constant-global
            batch is smaller than the world (some ranks would get no data).
    """
    _check_positive("world_size", world_size)
    if not 0 <= rank < world_size:
        raise BatchPolicyError(f"rank {rank} is outside a world of {world_size}")
    global_batch = _global_batch(policy, world_size)
    shares = split_evenly(global_batch, world_size)
    accum = _accum_steps(policy, shares[0])
    return BatchPlan(
        policy=policy.spec,
        world_size=world_size,
        rank=rank,
        global_batch=global_batch,
        shares=shares,
        offset=sum(shares[:rank]),
        accum_steps=accum,
        micro_batch_sizes=split_evenly(shares[rank], accum),
        lr_factor=lr_factor(policy, world_size),
    )


def lr_factor(policy: BatchPolicy, world_size: int) -> float:
    """How much to scale the tuned learning rate for this world size."""
    if policy.name == CONSTANT_GLOBAL:
        return 1.0
    ratio = world_size / policy.base_world_size
    return math.sqrt(ratio) if policy.lr_rule == "sqrt" else ratio


def normalize_policy(text: str) -> str:
    """Canonical spec of a policy string; usable as an argparse ``type``.

    Raises:
        BatchPolicyError: if the text names no known policy.
    """
    key = text.strip().lower()
    if key == CONSTANT_LOCAL:
        return f"{CONSTANT_LOCAL}:linear"
    if key in ACCEPTED_POLICIES:
        return key
    raise BatchPolicyError(_unknown_policy_message(text))


def parse_policy(text: str, batch_size: int, *, base_world_size: int = 1,
                 max_per_rank: int | None = None) -> BatchPolicy:
    """Build a policy from its text form, e.g. ``constant-local:sqrt``.

    Args:
        text: one of ACCEPTED_POLICIES (case and surrounding spaces ignored);
            plain ``constant-local`` means the ``linear`` rule.
        batch_size: global batch for constant-global, per-rank batch for
            constant-local.
        base_world_size: world size the learning rate was tuned for.
        max_per_rank: micro-batch cap per rank, or None.

    Raises:
        BatchPolicyError: (a ValueError) for unknown text or bad sizes.
    """
    name, _, rule = normalize_policy(text).partition(":")
    if name == CONSTANT_GLOBAL:
        if base_world_size != 1:
            raise BatchPolicyError(
                f"base_world_size only applies to {CONSTANT_LOCAL}")
        return BatchPolicy.constant_global(batch_size, max_per_rank)
    return BatchPolicy.constant_local(batch_size, rule, base_world_size,
                                      max_per_rank)


def _global_batch(policy: BatchPolicy, world_size: int) -> int:
    if policy.name == CONSTANT_LOCAL:
        return policy.batch_size * world_size
    if policy.batch_size < world_size:
        raise BatchPolicyError(
            f"{CONSTANT_GLOBAL} batch {policy.batch_size} is smaller than the "
            f"world size {world_size}: some ranks would get no samples. Use a "
            f"global batch of at least {world_size}, fewer ranks, or "
            f"{CONSTANT_LOCAL}.")
    return policy.batch_size


def _accum_steps(policy: BatchPolicy, largest_share: int) -> int:
    if policy.max_per_rank is None or largest_share <= policy.max_per_rank:
        return 1
    return math.ceil(largest_share / policy.max_per_rank)


def _format_shares(shares: tuple[int, ...]) -> str:
    # Listing 64 ranks would drown the log line; group equal runs instead.
    if len(shares) <= 8:
        return "+".join(str(s) for s in shares)
    groups: list[str] = []
    for size in sorted(set(shares), reverse=True):
        groups.append(f"{size}x{shares.count(size)}")
    return "+".join(groups)


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BatchPolicyError(f"{name} must be a positive integer; got {value!r}")


def _unknown_policy_message(text: str) -> str:
    return (f"unknown batch policy {text!r}; accepted: "
            f"{', '.join(ACCEPTED_POLICIES)}")
