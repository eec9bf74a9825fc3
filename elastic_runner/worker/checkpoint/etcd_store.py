"""The newest verified checkpoint recorded in etcd, fenced by the round.

Why etcd: it is the job's one shared, highly available store, and its transactions
let the record move only forward and only while the writer's round is current.
The rules are those of every LatestStore (checkpoint_latest.refuses): a lower step
is refused, and so is the same step with another sha256, because two writers that
disagree about one step must not both win; the identical record is accepted again,
so a retried save is idempotent. A rotten record is replaced through retract(), not
by overwriting it.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Mapping

from elastic_runner.worker.checkpoint.latest import refuses
from elastic_runner.config import EtcdConfig
from elastic_runner.rendezvous import protocol as p
from elastic_runner.record_relay import ask_record, read_json

log = logging.getLogger(__name__)


class EtcdLatestStore:
    """publish() succeeds only while the next round has no plan yet: a node whose
    round is over cannot overwrite the record of the job that re-formed without it,
    yet workers draining for a resize (next round open, not closed) can still record
    the checkpoint the next round resumes from. retract() is fenced the same way.
    """

    def __init__(self, endpoints: tuple[str, ...], prefix: str, round_number: int,
                 options: Mapping[str, Any] | None = None):
        from elastic_runner.etcd.client import EtcdClient

        # A worker holds no lease: config.retry_deadline_s gives it two call timeouts.
        self._client = EtcdClient(EtcdConfig.build(endpoints, **dict(options or {})))
        self._key = p.checkpoint_key(prefix)
        self._next_plan_key = p.plan_key(prefix, round_number + 1)
        self._read = read_json(self._client, self._key)

    def read(self) -> dict | None:
        return self._read()

    def publish(self, record: dict) -> bool:
        from elastic_runner.etcd.client import Put, key_missing, mod_revision_is

        current = self._client.get(self._key)
        if current is not None and refuses(json.loads(current.value), record):
            return False
        guard = (mod_revision_is(self._key, current.mod_revision) if current
                 else key_missing(self._key))
        if self._client.txn([key_missing(self._next_plan_key), guard],
                            [Put(self._key, json.dumps(record).encode())]).succeeded:
            return True
        return self.read() == record  # a retried transaction that had already landed

    def retract(self, bad: dict, replacement: dict) -> bool:
        """Swap the record only while it is still exactly `bad`: racing readers agree."""
        from elastic_runner.etcd.client import Put, key_missing, mod_revision_is

        current = self._client.get(self._key)
        if current is None or json.loads(current.value) != bad:
            return False
        return self._client.txn(
            [key_missing(self._next_plan_key), mod_revision_is(self._key, current.mod_revision)],
            [Put(self._key, json.dumps(replacement).encode())]).succeeded

    def close(self) -> None:
        self._client.close()


class RelayedLatestStore:
    """read() asks the agent (record_relay.py: no etcd client, connection or import in
    the worker for it); publish() and retract(), rank 0's alone, go through a fenced
    EtcdLatestStore opened at the first of them.

    Where the agent does not listen (it is on its way out, or could not make its
    socket), read() falls back to etcd itself: slower, never staler.
    """

    def __init__(self, socket_path: str, open_store: Callable[[], EtcdLatestStore]):
        self._socket_path = socket_path
        self._open_store = open_store
        self._store: EtcdLatestStore | None = None

    def read(self) -> dict | None:
        try:
            return ask_record(self._socket_path)
        except OSError as error:
            log.debug("the agent did not relay the checkpoint record (%s): reading etcd", error)
            return self._own().read()

    def publish(self, record: dict) -> bool:
        return self._own().publish(record)

    def retract(self, bad: dict, replacement: dict) -> bool:
        return self._own().retract(bad, replacement)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def _own(self) -> EtcdLatestStore:
        if self._store is None:
            self._store = self._open_store()
        return self._store
