"""A plan's members as columns, a Member built only when one is asked for.

Why: every agent parses every round's plan, and almost all of them need one
member (their own), the node ids and the world size. Building a Member object
for each of 1,024 members was most of an agent's Python time per round at that
size (py-spy, bench/rendezvous_scale.py), and with many agents in one process,
those allocations also ran the garbage collector over all of them. Columns are
the plan record's own shape (format 2), so reading one costs a few tuple copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Iterator, overload

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Member:
    """One node of a plan (protocol.Plan): its workers hold global ranks
    first_rank .. first_rank + nproc - 1."""

    node_id: str
    node_rank: int
    nproc: int
    addr: str
    first_rank: int
    labels: Labels = ()


class MemberTable(Sequence):
    """Immutable, compares equal to the tuple of Members it stands for."""

    __slots__ = ("ids", "nprocs", "addrs", "labels", "first_ranks")

    def __init__(self, ids: tuple[str, ...], nprocs: tuple[int, ...], addrs: tuple[str, ...],
                 labels: tuple[Labels, ...]):
        for name, column in (("ids", ids), ("nprocs", nprocs), ("addrs", addrs),
                             ("labels", labels)):
            object.__setattr__(self, name, tuple(column))
        object.__setattr__(self, "first_ranks", tuple(accumulate(nprocs, initial=0))[:-1])

    def __setattr__(self, name, value):
        raise AttributeError("a MemberTable is immutable")

    def __reduce__(self):
        return MemberTable, (self.ids, self.nprocs, self.addrs, self.labels)

    @staticmethod
    def of(members: Sequence[Member]) -> "MemberTable":
        if isinstance(members, MemberTable):
            return members
        return MemberTable(tuple(m.node_id for m in members), tuple(m.nproc for m in members),
                           tuple(m.addr for m in members), tuple(m.labels for m in members))

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, index: int) -> Member: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Member, ...]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        i = range(len(self.ids))[index]  # IndexError, negative indices as a tuple's
        return _member(self.ids[i], i, self.nprocs[i], self.addrs[i], self.first_ranks[i],
                       self.labels[i])

    def __iter__(self) -> Iterator[Member]:
        return (self[i] for i in range(len(self.ids)))

    def __eq__(self, other) -> bool:
        if isinstance(other, MemberTable):
            return (self.ids, self.nprocs, self.addrs, self.labels) == \
                (other.ids, other.nprocs, other.addrs, other.labels)
        if isinstance(other, (tuple, list)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"MemberTable({list(self)!r})"


def _member(node_id: str, node_rank: int, nproc: int, addr: str, first_rank: int,
            labels: Labels) -> Member:
    """Member(...) without the frozen dataclass's __init__ (object.__setattr__ per
    field); Member has no __post_init__ to skip."""
    member = object.__new__(Member)
    member.__dict__.update(node_id=node_id, node_rank=node_rank, nproc=nproc, addr=addr,
                           first_rank=first_rank, labels=labels)
    return member
