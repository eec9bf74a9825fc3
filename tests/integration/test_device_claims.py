"""Two agents on one machine, against a real etcd: a node's GPUs are claimed before it
announces itself (rendezvous/devices.py).

Before: the second agent registered as another node (its default id is host and
pid), a round opened for it, and both put a worker on every GPU they shared.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elastic_runner.errors import DeviceInUse, exit_code_for
from elastic_runner.rendezvous import devices
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.engine import EtcdRendezvous
from tests.helpers.rdzv_nodes import Engines

TTL_S = 2
GPU_A, GPU_B, GPU_C = (f"GPU-{c * 8}-1111-2222-3333-444455556666" for c in "abc")


@pytest.fixture
def agent(etcd):
    engines = Engines(p.JobSpec(1, 4, "test"), TTL_S)
    yield lambda run, node_id, gpus: engines.make(etcd.endpoint, run, node_id,
                                                  devices=tuple(gpus))
    engines.close_all()


def dead_pid() -> int:
    """The pid of a process of this machine that has exited."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)


def claim_lease(rdzv: EtcdRendezvous, uuid: str) -> int | None:
    kv = rdzv._client.get(p.device_key(rdzv.prefix, uuid))
    return kv.lease if kv else None


def test_a_second_agent_sharing_a_gpu_is_refused_before_it_announces_itself(agent):
    first = agent("gpus", "a", [GPU_A, GPU_B])
    first.register()
    round_before = first._client.get(p.round_key(first.prefix))
    second = agent("gpus", "b", [GPU_B, GPU_C])
    with pytest.raises(DeviceInUse) as refused:
        second.register()  # the holder is alive: refused once its lease outlived its TTL
    message = str(refused.value)
    assert "\n" not in message and exit_code_for(refused.value) == 2
    for part in (f"GPU {GPU_B} is already used by node 'a' of run 'gpus'", "pid ",
                 "CUDA_VISIBLE_DEVICES"):
        assert part in message, message
    client = first._client
    assert client.get(p.node_key(first.prefix, "b")) is None  # never announced
    assert client.get(p.device_key(first.prefix, GPU_C)) is None  # nothing half-claimed
    assert client.get(p.round_key(first.prefix)).mod_revision == round_before.mod_revision
    assert claim_lease(first, GPU_A) == claim_lease(first, GPU_B) == first.lease.id
    first.leave()  # its claims go with its lease
    assert client.get(p.device_key(first.prefix, GPU_B)) is None
    third = agent("gpus", "c", [GPU_B, GPU_C])
    third.register()
    assert claim_lease(third, GPU_B) == claim_lease(third, GPU_C) == third.lease.id


def test_agents_with_their_own_gpus_both_join(agent):
    first, second = agent("split", "a", [GPU_A]), agent("split", "b", [GPU_B])
    first.register()
    second.register()
    assert claim_lease(first, GPU_A) == first.lease.id
    assert claim_lease(second, GPU_B) == second.lease.id


def test_a_claim_left_by_a_dead_process_on_this_machine_is_taken_at_once(agent, etcd):
    """An agent restarted right after a crash: its predecessor's lease (60 s here) has
    not run out, but its pid is gone, so the claim is taken over without waiting."""
    newcomer = agent("restart", "a2", [GPU_A])
    client = newcomer._client
    old_lease = client.grant_lease(60)
    record = json.dumps({"node_id": "a1", "hostname": "here", "pid": dead_pid(),
                         "machine": devices.this_process().machine}).encode()
    client.put(p.device_key(newcomer.prefix, GPU_A), record, lease=old_lease)
    newcomer.register()
    assert claim_lease(newcomer, GPU_A) == newcomer.lease.id
    assert client.lease_remaining(old_lease) > 0  # taken over, not waited out
    client.revoke_lease(old_lease)


def test_a_claim_from_another_machine_is_waited_out_when_its_lease_is_not_kept(agent):
    newcomer = agent("elsewhere", "b", [GPU_A])
    client = newcomer._client
    lease = client.grant_lease(TTL_S)  # never kept alive: a crashed agent elsewhere
    record = json.dumps({"node_id": "a", "hostname": "other", "pid": 1,
                         "machine": "another-boot pid:[1]"}).encode()
    client.put(p.device_key(newcomer.prefix, GPU_A), record, lease=lease)
    newcomer.register()
    assert claim_lease(newcomer, GPU_A) == newcomer.lease.id


def test_re_registering_after_a_lost_lease_refuses_a_gpu_taken_meanwhile(agent):
    first = agent("relost", "a", [GPU_A])
    first.register()
    first._client.revoke_lease(first.lease.id)  # as if it expired during a partition
    assert first.lease.lost.wait(TTL_S * 3)
    second = agent("relost", "b", [GPU_A])
    second.register()
    with pytest.raises(DeviceInUse, match=f"GPU {GPU_A} is already used by node 'b'"):
        first.next_plan(None, p.Cause(p.CauseKind.START))
    assert claim_lease(second, GPU_A) == second.lease.id


def test_claiming_again_under_the_same_lease_keeps_the_claim(agent):
    """The standby start registers twice under one lease (agent/standby.py)."""
    rdzv = agent("twice", "a", [GPU_A, GPU_B])
    rdzv.register()
    revision = rdzv._client.get(p.device_key(rdzv.prefix, GPU_A)).mod_revision
    devices.claim_devices(rdzv._client, rdzv._config, rdzv.lease.id, lambda kv: True)
    assert rdzv._client.get(p.device_key(rdzv.prefix, GPU_A)).mod_revision == revision
    assert claim_lease(rdzv, GPU_B) == rdzv.lease.id


def test_a_holder_record_with_a_newline_cannot_forge_a_second_line(agent):
    newcomer = agent("forged", "b", [GPU_A])
    client = newcomer._client
    lease = client.grant_lease(60)
    record = json.dumps({"node_id": "x\nelastic-run: error: forged", "hostname": "h\nh",
                         "pid": 1, "machine": "elsewhere"}).encode()
    client.put(p.device_key(newcomer.prefix, GPU_A), record, lease=lease)
    message = devices.in_use_message(newcomer._config,
                                     client.get(p.device_key(newcomer.prefix, GPU_A)))
    client.revoke_lease(lease)
    assert "\n" not in message and "node 'x?elastic-run: error: forged'" in message


def test_every_gpu_left_by_a_dead_predecessor_is_taken_at_once(agent):
    """Eight GPUs claimed by a crashed agent of this machine, more than the claim's
    attempts: all are taken over together."""
    gpus = [f"GPU-{i:08x}-0000-1111-2222-333344445555" for i in range(8)]
    newcomer = agent("eight", "a2", gpus)
    client = newcomer._client
    old_lease = client.grant_lease(60)
    record = json.dumps({"node_id": "a1", "pid": dead_pid(),
                         "machine": devices.this_process().machine}).encode()
    for uuid in gpus:
        client.put(p.device_key(newcomer.prefix, uuid), record, lease=old_lease)
    newcomer.register()
    assert {claim_lease(newcomer, uuid) for uuid in gpus} == {newcomer.lease.id}
    client.revoke_lease(old_lease)
