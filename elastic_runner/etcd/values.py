"""The values the etcd facade speaks: records read, events watched, transactions.

Plain frozen dataclasses with no etcd library behind them, so the rendezvous
builds and reads transactions without importing the client (only client.py
does), and tests build them without a server.
"""

from __future__ import annotations

from dataclasses import dataclass

# etcd's default --max-txn-ops: it refuses a transaction with more operations in a
# branch ("too many operations in txn request").
MAX_TXN_OPS = 128


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease: int


# Transaction building blocks: plain data, so callers never touch pyetcd types.
@dataclass(frozen=True)
class Compare:
    key: str
    target: str  # "create", "mod", "version", "value"
    op: str  # "==", "!=", "<", ">"
    operand: int | bytes
    # Compare every key under `key` as a prefix: etcd (3.3+) holds the compare for
    # every key in the range, and compares 0 when the range is empty.
    prefix: bool = False


def key_missing(key: str) -> Compare:
    return Compare(key, "create", "==", 0)


def prefix_empty(prefix: str) -> Compare:
    return Compare(prefix, "create", "==", 0, prefix=True)


def mod_revision_is(key: str, revision: int) -> Compare:
    return Compare(key, "mod", "==", revision)


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    lease: int | None = None


@dataclass(frozen=True)
class Delete:
    key: str
    prefix: bool = False


@dataclass(frozen=True)
class Get:
    """A read inside a transaction; its answer is in TxnResult.reads, in order.

    It sees the writes made before it in the same transaction (etcd reads a
    transaction's own changes), so a read placed last shows the store as the
    transaction left it, at TxnResult.revision.
    """

    key: str
    prefix: bool = False
    count_only: bool = False
    end: str | None = None  # read [key, end) instead of one key or a prefix


@dataclass(frozen=True)
class Nested:
    """A transaction inside a transaction (etcd 3.3+): its compares see the outer
    transaction's writes made before it, and all of it commits as one write. Its
    reads are not returned (TxnResult.reads holds the outer level's only)."""

    compares: tuple["Compare", ...]
    success: tuple["Put | Delete | Get | Nested", ...]
    failure: tuple["Put | Delete | Get | Nested", ...] = ()


@dataclass(frozen=True)
class Read:
    count: int
    kvs: tuple[KeyValue, ...]


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    reads: tuple[Read, ...] = ()
