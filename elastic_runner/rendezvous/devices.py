"""Claiming this node's GPUs in etcd before the node announces itself.

Why (cli/gpus.py tells how the clash happens): a second agent started on a machine
whose GPUs a running agent of the run already uses would join as a new node, and
NCCL refuses the re-formed communicator (two ranks on one GPU): the running job
ends in a crash loop. Each GPU a node's workers use is a key `devices/<uuid>`
under that node's lease, all created in one transaction, before the node key: the
second agent is refused, with one line, before any agent of the running job can see
it, so no round opens for it.

A claim outlives a crashed agent only as long as its lease. An agent restarted at
once on the same machine would wait out that TTL, so a claim whose holder was this
machine's, in our process namespace, and whose process is gone, is taken over at
once; any other holder is waited for the way a held node id is (registration.py):
a key that outlives its lease's TTL belongs to a live agent.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable

from elastic_runner.config import RendezvousConfig
from elastic_runner.errors import DeviceInUse
from elastic_runner.etcd.client import (
    Delete, EtcdClient, Get, KeyValue, Put, key_missing, mod_revision_is,
)
from elastic_runner.etcd.values import MAX_TXN_OPS
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.holders import holder_record, printable, who

CLAIM_ATTEMPTS = 4


@dataclass(frozen=True)
class ThisProcess:
    """Where a claim's holder ran: its pid means something only to a process that
    shares its kernel boot and pid namespace."""
    pid: int
    machine: str  # boot id and pid namespace; "" where /proc does not tell


def this_process() -> ThisProcess:
    return ThisProcess(os.getpid(), _machine())  # the pid is read again: a fork changes it


@cache
def _machine() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot} {namespace}"


def claim_record(config: RendezvousConfig, me: ThisProcess) -> bytes:
    return json.dumps({"node_id": config.node_id, "hostname": socket.gethostname(),
                       "pid": me.pid, "machine": me.machine}).encode()


def claim_devices(client: EtcdClient, config: RendezvousConfig, lease_id: int,
                  outlives_lease: Callable[[KeyValue], bool],
                  me: ThisProcess | None = None) -> None:
    """Hold every GPU in config.devices under `lease_id`, or raise DeviceInUse.

    `outlives_lease(kv)` waits out a holder's lease: True when its key is still there
    after (registration.py). Keys already ours (an earlier claim under this lease,
    the standby start's first registration) are kept as they are.
    """
    if not config.devices:
        return  # a machine without GPUs: no request at all
    me = me or this_process()
    record = claim_record(config, me)
    wanted = [p.device_key(config.prefix, uuid) for uuid in config.devices[:MAX_TXN_OPS]]
    holder: KeyValue | None = None
    for attempt in range(CLAIM_ATTEMPTS):
        result = client.txn([key_missing(key) for key in wanted],
                            [Put(key, record, lease_id) for key in wanted],
                            [Get(key) for key in wanted])
        if result.succeeded:
            return
        held = [read.kvs[0] for read in result.reads if read.kvs]
        wanted = [key for key in wanted
                  if not any(kv.key == key and kv.lease == lease_id for kv in held)]
        others = [kv for kv in held if kv.lease != lease_id]
        holder = others[0] if others else holder
        if attempt == CLAIM_ATTEMPTS - 1:
            break
        left = [kv for kv in others if _left_behind(kv, me, config.node_id)]
        if left:  # each only while unchanged since our read
            client.txn([mod_revision_is(kv.key, kv.mod_revision) for kv in left],
                       [Delete(kv.key) for kv in left])
        live = [kv for kv in others if kv not in left]
        if live and outlives_lease(live[0]):
            holder = live[0]
            break
    raise DeviceInUse(in_use_message(config, holder))


def _left_behind(holder: KeyValue, me: ThisProcess, node_id: str) -> bool:
    """Whether `holder` was claimed on this machine by a process that is gone, or by
    this very agent under a lease it lost: then nobody uses the GPU through it."""
    record = holder_record(holder)
    pid = record.get("pid")
    if not me.machine or record.get("machine") != me.machine or not isinstance(pid, int):
        return False
    if pid == me.pid:
        return record.get("node_id") == node_id
    return not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: it exists
    return True


def in_use_message(config: RendezvousConfig, holder: KeyValue | None) -> str:
    """One line: which GPU, who holds it, and what to do."""
    record = holder_record(holder)
    uuid = p.node_id_from_key(holder.key) if holder is not None else "?"
    held_by = who(record, (("hostname", "host"), ("pid", "pid")))
    node = printable(record.get("node_id", "?"))
    return (f"GPU {uuid} is already used by node '{node}' of run {config.run_id!r}"
            f"{f' ({held_by})' if held_by else ''}: two agents on one machine would put two "
            "workers on one GPU, and NCCL would end the running job for it. Stop that agent first, "
            "or give each agent its own GPUs with CUDA_VISIBLE_DEVICES")
