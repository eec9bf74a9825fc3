"""EtcdStore: torch's c10d Store kept in etcd under one key prefix.

Why: torchrun's agents coordinate through the Store a rendezvous hands them
(rank assignment, the exit barrier). torch's c10d backend keeps it in a TCPStore
hosted by one node, so that node's death takes the control plane with it; here it
lives in etcd, which outlives any node.

Choices written down here:
- Blocking reads (get, wait, multi_get) first read etcd; only if a key is missing
  they watch from the revision just read, so no write in between is missed, and
  wait on an Event the watch sets. The wait is sliced (a re-read every
  `_RECHECK_S`), so a watch stream that broke silently costs at most one slice.
- `add` and `compare_set` are etcd transactions guarded by the key's mod revision
  (or its absence), so concurrent agents never lose an update; `add` retries a
  lost race (tenacity, at once, bounded by the store timeout, then DistStoreError):
  every lost race means another add won. The blocking reads' sliced wait is not a
  retry of a failed call but a watch with a periodic re-read; it stays a plain loop.
- Values are bytes; str values are UTF-8 encoded like c10d does. Counters are
  decimal strings, as in every c10d store, so `get` of an `add` key reads b"5".
- Timeouts raise torch's DistStoreError and etcd failures DistNetworkError:
  the types torch's own code (e.g. the barrier's missing-rank tracing) expects.
- The timeout is the base class's (`timeout`, `set_timeout`), so torch's
  `store_timeout` context manager works unchanged.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from datetime import timedelta
from typing import Callable, Iterable, TypeVar

from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay
from torch.distributed import DistNetworkError, DistStoreError, Store

from elastic_runner.errors import EtcdError
from elastic_runner.etcd.client import (
    Compare, Delete, EtcdClient, Put, WatchEvent, key_missing, mod_revision_is,
)
from elastic_runner.etcd.values import MAX_TXN_OPS  # multi_set splits bigger batches

# Longest single sleep of a blocking read before it re-reads etcd itself.
_RECHECK_S = 1.0

T = TypeVar("T")


def _etcd_errors_as_torch(method: Callable[..., T]) -> Callable[..., T]:
    """Let torch's callers see its own network error type, with our message."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except EtcdError as exc:
            raise DistNetworkError(f"EtcdStore.{method.__name__}: {exc}") from exc
    return wrapper


def as_bytes(value: str | bytes | bytearray | Iterable[int]) -> bytes:
    """c10d hands values as str, bytes or a list of ints, depending on the caller."""
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdStore(Store):
    """A c10d Store whose keys live in etcd under `prefix`."""

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta | None = None):
        super().__init__()  # the pybind trampoline needs its base initialised
        self._client = client
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        if timeout is not None:
            self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self.prefix + key

    # ---- writes -----------------------------------------------------------------
    @_etcd_errors_as_torch
    def set(self, key: str, value) -> None:
        self._client.put(self._key(key), as_bytes(value))

    @_etcd_errors_as_torch
    def multi_set(self, keys: list[str], values: list) -> None:
        """One transaction per batch: readers see a batch all at once or not at all."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        puts = [Put(self._key(k), as_bytes(v)) for k, v in zip(keys, values)]
        for start in range(0, len(puts), MAX_TXN_OPS):
            self._client.txn([], puts[start:start + MAX_TXN_OPS])

    @_etcd_errors_as_torch
    def add(self, key: str, amount: int) -> int:
        """Add to a counter; a lost race is retried at once until the store timeout.

        No pause between tries: each lost race means another add won, so the counter
        moves on. etcd failures are not retried here (the client already retried
        them); they propagate as they are.
        """
        timeout_s = self.timeout.total_seconds()
        retrying = Retrying(stop=stop_after_delay(timeout_s),
                            retry=retry_if_result(lambda new: new is None))
        try:
            return retrying(self._add_once, self._key(key), amount)
        except RetryError:
            raise DistStoreError(f"EtcdStore.add({key!r}) kept losing races for "
                                 f"{timeout_s:g} s") from None

    def _add_once(self, full: str, amount: int) -> int | None:
        """One read-add-write guarded by the key's mod revision: the new value, or
        None when another writer changed the key in between."""
        kv = self._client.get(full)
        new = (int(kv.value) if kv else 0) + amount
        guard = mod_revision_is(full, kv.mod_revision) if kv else key_missing(full)
        if self._client.txn([guard], [Put(full, str(new).encode())]).succeeded:
            return new
        return None

    @_etcd_errors_as_torch
    def compare_set(self, key: str, expected_value, desired_value) -> bytes:
        """Set if the value is `expected_value`; return the value the key holds now.

        As in TCPStore: an empty `expected_value` means "only if absent", and a
        missing key with a non-empty expectation returns the expectation.
        """
        full, expected, desired = self._key(key), as_bytes(expected_value), as_bytes(desired_value)
        guard = key_missing(full) if not expected else Compare(full, "value", "==", expected)
        if self._client.txn([guard], [Put(full, desired)]).succeeded:
            return desired
        kv = self._client.get(full)
        return kv.value if kv else expected

    @_etcd_errors_as_torch
    def delete_key(self, key: str) -> bool:
        full = self._key(key)
        return self._client.txn([Compare(full, "create", ">", 0)], [Delete(full)]).succeeded

    # ---- reads ------------------------------------------------------------------
    @_etcd_errors_as_torch
    def get(self, key: str) -> bytes:
        return self._wait_for([key], self.timeout)[key]

    @_etcd_errors_as_torch
    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._wait_for(keys, self.timeout)
        return [values[k] for k in keys]

    @_etcd_errors_as_torch
    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_for(keys, self.timeout if timeout is None else timeout)

    @_etcd_errors_as_torch
    def check(self, keys: list[str]) -> bool:
        found, _ = self._read(keys)
        return len(found) == len(set(keys))

    @_etcd_errors_as_torch
    def num_keys(self) -> int:
        return len(self._client.get_prefix(self.prefix)[0])

    @_etcd_errors_as_torch
    def list_keys(self) -> list[str]:
        return [kv.key[len(self.prefix):] for kv in self._client.get_prefix(self.prefix)[0]]

    # ---- blocking -----------------------------------------------------------------
    def _read(self, keys: list[str]) -> tuple[dict[str, bytes], int]:
        """One range read covering every key: their values and the revision read at."""
        if not keys:
            return {}, 0
        wanted = {self._key(k): k for k in keys}
        entries, revision = self._client.get_prefix(_common_prefix(wanted))
        return {wanted[kv.key]: kv.value for kv in entries if kv.key in wanted}, revision

    def _wait_for(self, keys: list[str], timeout: timedelta) -> dict[str, bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        found, revision = self._read(keys)
        if len(found) == len(set(keys)) or time.monotonic() >= deadline:
            return self._complete_or_raise(keys, found, timeout)
        arrived = threading.Event()
        wanted = {self._key(k) for k in keys}

        def on_events(events: list[WatchEvent]) -> None:
            if any(e.kind == "put" and e.key in wanted for e in events):
                arrived.set()

        watch = self._client.watch_prefix(_common_prefix(wanted), revision + 1, on_events,
                                          on_compacted=lambda _: arrived.set())  # read again
        try:
            while len(found) < len(set(keys)):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                arrived.wait(min(remaining, _RECHECK_S))
                arrived.clear()  # before the re-read: a later put sets it again
                found, _ = self._read(keys)
        finally:
            watch.cancel()
        return self._complete_or_raise(keys, found, timeout)

    def _complete_or_raise(self, keys: list[str], found: dict[str, bytes],
                           timeout: timedelta) -> dict[str, bytes]:
        missing = [k for k in keys if k not in found]
        if missing:
            raise DistStoreError(
                f"EtcdStore: keys {missing} under {self.prefix} not set within "
                f"{timeout.total_seconds():g} s"
            )
        return found


def _common_prefix(full_keys: Iterable[str]) -> str:
    """The longest prefix of all keys: one range read or watch covers them all."""
    return os.path.commonprefix(sorted(full_keys))
