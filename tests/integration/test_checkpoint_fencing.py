"""The etcd checkpoint record is fenced by the round: a node whose round is over
(the next round has a plan) cannot publish, a draining one still can. A record
whose checkpoint rotted is retracted by compare-and-swap, under the same fence."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from elastic_runner.config import EtcdConfig
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.worker.checkpoint.etcd_store import EtcdLatestStore

PREFIX = "/elastic-runner/v2/fence/"


def context(endpoint: str, round_number: int) -> tuple:
    """EtcdLatestStore's arguments for a worker of `round_number`."""
    return (endpoint,), PREFIX, round_number


def record(step: int) -> dict:
    return {"url": f"file:///ckpt/step-{step}", "step": step, "sha256": "ab" * 32}


def test_stale_round_cannot_publish_but_draining_round_can(etcd):
    old, new = EtcdLatestStore(*context(etcd.endpoint, 3)), EtcdLatestStore(*context(etcd.endpoint, 4))
    assert old.publish(record(10))          # round 4 open, no plan: round 3 drains and records
    client = EtcdClient(EtcdConfig((etcd.endpoint,), 2.0, 5.0))
    client.put(f"{PREFIX}rounds/4/plan", b"{}")
    assert not old.publish(record(12))      # round 4 closed: round 3 is fenced off
    assert new.publish(record(11))
    assert not new.publish(record(9))       # never backwards
    assert json.loads(client.get(f"{PREFIX}checkpoint/latest").value)["step"] == 11
    client.close()


# ---- a record whose checkpoint rots stops fencing (issue 12) ----------------------------
def flip_a_byte(root, step: int) -> None:
    state = root / f"step-{step:08d}" / "state.pt"
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    state.write_bytes(bytes(raw))


def test_retract_swaps_only_the_exact_bad_record_and_racers_agree(etcd):
    store = EtcdLatestStore(*context(etcd.endpoint, 0))
    assert store.publish(record(20))
    racers = [EtcdLatestStore(*context(etcd.endpoint, 0)) for _ in range(4)]
    with ThreadPoolExecutor(len(racers)) as pool:
        won = list(pool.map(lambda s: s.retract(record(20), record(10)), racers))
    assert won.count(True) == 1 and store.read() == record(10)
    assert not store.retract({**record(10), "sha256": "cd" * 32}, record(5))
    assert store.read() == record(10)


def test_a_reader_whose_round_is_over_cannot_retract(etcd):
    old = EtcdLatestStore(*context(etcd.endpoint, 3))
    assert old.publish(record(20))
    client = EtcdClient(EtcdConfig((etcd.endpoint,), 2.0, 5.0))
    client.put(f"{PREFIX}rounds/4/plan", b"{}")
    assert not old.retract(record(20), record(10))
    assert EtcdLatestStore(*context(etcd.endpoint, 4)).retract(record(20), record(10))
    client.close()


def test_rotten_newest_checkpoint_is_redone_and_published_again(etcd, tmp_path):
    import torch

    from elastic_runner.worker.checkpoint.checkpointer import Checkpointer

    first = Checkpointer(tmp_path, keep=None, latest_store=EtcdLatestStore(
        *context(etcd.endpoint, 0)))
    for step in (10, 20):
        first.save(step, {"w": torch.full((4,), float(step))})
    flip_a_byte(tmp_path, 20)
    store = EtcdLatestStore(*context(etcd.endpoint, 1))   # the restarted round
    others = Checkpointer(tmp_path, rank=1, latest_store=store)
    assert others.load_latest()["w"][0] == 10 and store.read()["step"] == 20  # rank 1 reads only
    rank0 = Checkpointer(tmp_path, keep=None, latest_store=store)
    assert rank0.load_latest()["w"][0] == 10
    assert store.read()["step"] == 10 and store.read()["url"].endswith("step-00000010")
    assert others.load_latest()["w"][0] == 10  # every rank agrees afterwards too
    rank0.save(20, {"w": torch.full((4,), 20.5)})   # was "writer was fenced" before the fix
    assert store.read()["step"] == 20
    assert Checkpointer(tmp_path, rank=1, latest_store=store).load_latest()["w"][0] == 20.5
