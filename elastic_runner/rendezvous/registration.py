"""Registering a node: the run's job spec, then this node's key under its own lease.

Why create-if-absent: with a plain put, a second agent started with the same
--node-id overwrote the first one's key, and each then ran as rank 0 of a world
of one. The node key is now created only where none exists, under the creating
agent's lease, so one live agent holds an id at a time, and the id is free again
once that lease is gone (revoked on exit, expired after a crash). Re-registering
after our own lease was lost goes through the same check: our old key went with
the old lease, and an agent that took the id meanwhile is a duplicate too.

Why wait before calling a held id a duplicate: a node restarted right after a
crash finds its old key still held by the dead agent's lease. We wait out that
lease's remaining TTL, as etcd reports it (no other machine's clock involved);
a key that outlives it belongs to an agent that renewed its lease: a live one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import time
from typing import Callable, Sequence

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt

from elastic_runner.config import RendezvousConfig
from elastic_runner.errors import (
    DeviceInUse, DuplicateNodeId, EtcdAuthError, EtcdError, LeaseNotFound, SchemaMismatch,
    SpecMismatch,
)
from elastic_runner.etcd.client import (
    Compare, EtcdClient, Get, KeyValue, Nested, Put, TxnResult, key_missing, prefix_empty,
)
from elastic_runner.etcd.lease import KeptLease
from elastic_runner.rendezvous import carried_plan, devices
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.holders import holder_record, who

log = logging.getLogger(__name__)

# etcd checks for expired leases every 500 ms, and a leader change extends every
# lease by an election timeout: a dead holder's key may outlive its TTL by this much.
EXPIRY_SLACK_S = 2.0
# Create attempts per registration: a key freed and taken again this often while we
# tried means live agents are competing for the id.
CLAIM_ATTEMPTS = 3
# How often a dead holder's key is looked for while its lease runs out.
HOLDER_POLL_S = 0.25


def check_spec(client: EtcdClient, config: RendezvousConfig, spec: p.JobSpec) -> None:
    """Write the run's job spec, or check ours against the one the run started with.

    One transaction: create the spec only where no older elastic-runner wrote keys
    of this run (prefix compares), else read what is there. Why one: every agent
    of a thousand starting at once sends it; four requests each (two counts, a
    create, a read) were a third of the start's requests. A role limited to this
    run may not look at the older prefixes: then the counts it may not make are
    taken as 0, one request at a time, as before.
    """
    key = p.spec_key(config.prefix)
    older = _older_prefixes(config)
    try:
        result = client.txn([key_missing(key), *map(prefix_empty, older)],
                            [Put(key, spec.to_json()), Put(*_new_origin(config.prefix))],
                            [Get(key), *(Get(o, prefix=True, count_only=True) for o in older)])
    except EtcdAuthError:
        return _check_spec_stepwise(client, config, spec, older)
    if result.succeeded:
        return
    existing, *older_counts = result.reads
    for schema, found in zip(p.OLDER_SCHEMA_PREFIXES, older_counts):
        if found.count:
            raise _older_schema(config, schema)
    if not existing.kvs:  # the spec went between the compare and the read: look again,
        return _check_spec_stepwise(client, config, spec, older)  # once, step by step
    _compare_spec(config, existing.kvs[0], spec)


def _new_origin(prefix: str) -> tuple[str, bytes]:
    return p.origin_key(prefix), secrets.token_hex(8).encode()


def run_origin(client: EtcdClient, prefix: str, known: KeyValue | None) -> str:
    """The run's origin token (protocol.origin_key): `known`, the key as our copy holds
    it, else read, and written first where the run's spec came without one (an older
    elastic-runner's, or a role that checks the spec step by step)."""
    if known is None:
        key, fresh = _new_origin(prefix)
        answer = client.txn([key_missing(key)], [Put(key, fresh)], [Get(key)])
        if answer.succeeded:
            return fresh.decode()
        known = answer.reads[0].kvs[0]
    token = known.value.decode(errors="replace")
    if re.fullmatch(r"[0-9a-f]{8,64}", token):
        return token
    log.warning("the run's origin key %s holds %r, not a token elastic-runner wrote; "
                "checkpoint manifests name the run id only", known.key, token[:80])
    return ""


def _older_prefixes(config: RendezvousConfig) -> list[str]:
    """This run's prefix under each older schema, in OLDER_SCHEMA_PREFIXES' order."""
    return [f"{schema}/{config.run_id}/" for schema in p.OLDER_SCHEMA_PREFIXES]


def _check_spec_stepwise(client: EtcdClient, config: RendezvousConfig, spec: p.JobSpec,
                         older: list[str]) -> None:
    for schema, prefix in zip(p.OLDER_SCHEMA_PREFIXES, older):
        if _count_readable(client, prefix):
            raise _older_schema(config, schema)
    key = p.spec_key(config.prefix)
    if not client.create_if_absent(key, spec.to_json()):
        _compare_spec(config, client.get(key), spec)


def _older_schema(config: RendezvousConfig, schema: str) -> SchemaMismatch:
    return SchemaMismatch(
        f"run {config.run_id!r} has keys under {schema}/ written by an older "
        "elastic-runner; finish it with that version, or pass a new --run-id")


def _compare_spec(config: RendezvousConfig, existing: KeyValue, spec: p.JobSpec) -> None:
    conflict = p.spec_conflict(p.JobSpec.from_json(existing.value), spec)
    if conflict:
        raise SpecMismatch(
            f"run {config.run_id!r} already runs a different job ({conflict}); "
            "start this node with the same flags and script, or pass a new --run-id"
        )


def _count_readable(client: EtcdClient, prefix: str) -> int:
    """Keys under prefix; 0 where an etcd role limited to this run may not look."""
    try:
        return client.count_prefix(prefix)
    except EtcdAuthError:
        return 0


def node_record(config: RendezvousConfig, wall_clock: Callable[[], float]) -> bytes:
    """What a node key holds: who to look for when its id is contested, and for `status`.

    `registered_at` is this machine's wall clock, for display only: no decision
    compares it with another machine's clock.
    """
    return json.dumps({"node_id": config.node_id, "addr": config.node_addr,
                       "hostname": socket.gethostname(), "pid": os.getpid(),
                       "nproc": config.nproc, "labels": dict(config.labels),
                       "registered_at": wall_clock()}).encode()


# What registration writes or reads besides the node key, in the same transaction:
# built from the fresh lease's id.
AlsoOps = Callable[[int], Sequence["Put | Get | Nested"]]

# register_node's answer instead of a registration when it was asked to register only
# if the run does not re-form in place, and it does: nothing written, the lease kept
# for the registration that follows the standby start (agent/standby.py).
STAND_BY = TxnResult(succeeded=False, revision=-1)


def _in_place_reads(prefix: str) -> list[Get]:
    """What _stands_by decides from, in its order: the spec, the mark, the round key."""
    return [Get(p.spec_key(prefix)), Get(p.inplace_key(prefix)), Get(p.round_key(prefix))]


def take_lease(client: EtcdClient, config: RendezvousConfig, record: bytes,
               on_lost: Callable[[], None], attempts: int = 2,
               also: AlsoOps = lambda lease_id: (),
               spec: p.JobSpec | None = None, held: KeptLease | None = None,
               unless_in_place: bool = False) -> tuple[KeptLease, TxnResult | None]:
    """Grant a lease (or use `held`, one granted for us before) and create this node's
    key under it, with `also(lease)`'s ops; with `spec`, check the job spec first
    (register_node, which also reads what `unless_in_place` asks).

    A lease can expire between the grant and the create when this process is
    starved of CPU for longer than the TTL; a retry with a fresh lease turns
    that into a delay instead of a crash.

    Returns the lease and the creating transaction's result (its reads are
    `also`'s); None when an earlier create of ours was found done (its answer
    was lost); STAND_BY when `unless_in_place` and the run re-forms in place.

    Raises:
        SpecMismatch / SchemaMismatch: the run id belongs to another job.
        DuplicateNodeId: a live agent of this run holds our --node-id.
        DeviceInUse: a live agent of this run holds a GPU our workers would use.
        LeaseNotFound: every one of `attempts` fresh leases expired before the create.
    """
    retrying = Retrying(retry=retry_if_exception_type(LeaseNotFound),
                        stop=stop_after_attempt(attempts), reraise=True)
    given = [held] if held is not None else []

    def attempt() -> tuple[KeptLease, TxnResult | None]:
        lease = given.pop() if given else KeptLease(client, config.lease_ttl_s, on_lost=on_lost)
        return _claim_under(lease, client, config, record, also, spec, unless_in_place)
    try:
        return retrying(attempt)
    except LeaseNotFound as exc:
        raise LeaseNotFound(
            f"node {config.node_id!r} could not register: {attempts} fresh leases expired "
            f"before its key was written ({exc}); the agent is starved of CPU or etcd is "
            f"slower than --lease-ttl {config.lease_ttl_s:g} s: give it more CPU or a longer "
            "--lease-ttl") from exc


def _claim_under(lease: KeptLease, client: EtcdClient, config: RendezvousConfig,
                 record: bytes, also: AlsoOps, spec: p.JobSpec | None,
                 unless_in_place: bool) -> tuple[KeptLease, TxnResult | None]:
    try:
        # Before the node key: a clash must be refused before the run can see us.
        devices.claim_devices(client, config, lease.id,
                              lambda holder: _outlives_lease(client, holder))
        if spec is None:
            return lease, claim(client, config, record, lease.id, also(lease.id))
        return lease, register_node(client, config, spec, record, lease.id, also(lease.id),
                                    unless_in_place=unless_in_place)
    except (DuplicateNodeId, DeviceInUse, SpecMismatch, SchemaMismatch):
        lease.revoke()
        raise
    except EtcdError:
        lease.stop()
        raise


def register_node(client: EtcdClient, config: RendezvousConfig, spec: p.JobSpec,
                  record: bytes, lease_id: int, also: Sequence[Put | Get | Nested] = (),
                  unless_in_place: bool = False) -> TxnResult | None:
    """check_spec, then claim; in one transaction when the run's spec is ours already.

    Why: at a start of a thousand agents, all but the first find the spec there.
    One transaction guards the create with the spec's exact bytes (JobSpec's JSON
    is canonical: equal bytes, equal jobs) and the older schemas' empty prefixes.
    Any other answer (no spec yet, another job's, older keys, our id held, or a
    role that may not compare the older prefixes) takes the steps one by one,
    which write the spec or say what is wrong.

    `unless_in_place`: also guard on the run not being marked as re-forming in
    place; where it is, the failed transaction's reads tell, and STAND_BY comes
    back with nothing written. Why here: that question was a request of its own
    that every agent sent at its start, a quarter of a start's requests at a
    thousand agents, and it almost always finds no mark (a run's first start).
    """
    node = p.node_key(config.prefix, config.node_id)
    guards = [key_missing(node), Compare(p.spec_key(config.prefix), "value", "==",
                                         spec.to_json()),
              *map(prefix_empty, _older_prefixes(config))]
    failure_reads: list[Get] = []
    if unless_in_place:
        guards.append(key_missing(p.inplace_key(config.prefix)))
        failure_reads = _in_place_reads(config.prefix)
    try:
        result = client.txn(guards, [Put(node, record, lease_id), *also], failure_reads)
    except EtcdAuthError:
        result = None
    if result is not None and result.succeeded:
        return result
    if unless_in_place and _stands_by(client, config, spec, result):
        return STAND_BY
    check_spec(client, config, spec)
    return claim(client, config, record, lease_id, also)


def _stands_by(client: EtcdClient, config: RendezvousConfig, spec: p.JobSpec,
               failed: TxnResult | None) -> bool:
    """After register_node's guards failed: is this node of the run (our spec), and
    does the run re-form in place? Read again where the transaction was refused
    (a role that may not compare the older prefixes)."""
    reads = failed.reads if failed is not None else \
        client.txn([], _in_place_reads(config.prefix)).reads
    spec_read, mark_read, round_read = reads
    ours = bool(spec_read.kvs) and spec_read.kvs[0].value == spec.to_json()
    return ours and p.joins_in_place(round_read.kvs[0].value if round_read.kvs else None,
                                     bool(mark_read.kvs))


def with_node_key(prefix: str, node_id: str, lease_id: int, slot_ops: Sequence[Nested],
                  joiner: bytes | None) -> list[Put | Get | Nested]:
    """What the node key's create also does: open round 0 where no round exists, take
    a free deputy slot (`slot_ops`), and at a start (`joiner` given) join round 0 while
    it is the run's first round, still open, then read our join and the shared range.

    The reads come last, so they show what this transaction left (etcd's reads in a
    transaction see its own writes): TxnResult.reads is (our join, the shared range).
    """
    round_key = p.round_key(prefix)
    first_round = carried_plan.round_value(p.first_round(), None, None)
    ops: list[Put | Get | Nested] = [
        Nested((key_missing(round_key),), (Put(round_key, first_round),)), *slot_ops]
    if joiner is not None:
        join_key = p.join_key(prefix, 0, node_id)
        start, end = p.shared_range(prefix)
        ops += [Nested((Compare(round_key, "value", "==", first_round),),
                       (Put(join_key, joiner, lease_id),)),
                Get(join_key), Get(start, end=end)]
    return ops


def claim(client: EtcdClient, config: RendezvousConfig, record: bytes, lease_id: int,
          also: Sequence[Put | Get | Nested] = ()) -> TxnResult | None:
    """Create our node key under `lease_id` (and `also`, in the same transaction); wait
    out a dead holder, refuse a live one. Returns the creating transaction's result,
    None when the key was found already ours."""
    key = p.node_key(config.prefix, config.node_id)
    holder = None
    for _ in range(CLAIM_ATTEMPTS):
        result = client.txn([key_missing(key)], [Put(key, record, lease_id), *also])
        if result.succeeded:
            return result
        holder = client.get(key)
        if holder is None:
            continue  # freed between our create and our read
        if holder.lease == lease_id:
            return None  # our own create: its answer was lost and the retry found the key
        if _outlives_lease(client, holder):
            break
    raise DuplicateNodeId(duplicate_message(config, holder))


def _outlives_lease(client: EtcdClient, holder: KeyValue) -> bool:
    """Wait for `holder`'s lease to run out: True when its key is still there after.

    Asked of etcd, not of our copy: most agents copy no node keys (deputies.py).
    """
    if not holder.lease:
        return True  # written without a lease: it never expires
    remaining = max(client.lease_remaining(holder.lease), 0)  # -1 once expired
    deadline = time.monotonic() + remaining + EXPIRY_SLACK_S
    while True:
        kv = client.get(holder.key)
        if kv is None or kv.create_revision != holder.create_revision:
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(min(HOLDER_POLL_S, max(deadline - time.monotonic(), 0.0)))


def duplicate_message(config: RendezvousConfig, holder: KeyValue | None) -> str:
    """One line: which id, who holds it (from its record), and what to do."""
    held_by = who(holder_record(holder),
                  (("addr", "addr"), ("hostname", "host"), ("pid", "pid")))
    held_by = f"{held_by}; " if held_by else ""
    return (f"node id {config.node_id!r} is already registered by a live agent of run "
            f"{config.run_id!r} ({held_by}its lease stayed alive past its TTL); give this node "
            "another --node-id, or stop that agent first")
