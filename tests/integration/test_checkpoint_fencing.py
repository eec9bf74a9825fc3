"""The etcd checkpoint record is fenced by the round: a node whose round is over
(the next round has a plan) cannot publish, a draining one still can."""

from __future__ import annotations

import json

from elastic_runner.config import EtcdConfig
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.runtime import Context, EtcdLatestStore

PREFIX = "/elastic-runner/v1/fence/"


def context(endpoint: str, round_number: int) -> Context:
    return Context(rank=0, local_rank=0, world_size=2, local_world_size=1, restart_count=0,
                   round=round_number, run_id="fence", backend="gloo", device="cpu",
                   etcd_endpoints=(endpoint,), etcd_prefix=PREFIX)


def record(step: int) -> dict:
    return {"url": f"file:///ckpt/step-{step}", "step": step, "sha256": "ab" * 32}


def test_stale_round_cannot_publish_but_draining_round_can(etcd):
    old, new = EtcdLatestStore(context(etcd.endpoint, 3)), EtcdLatestStore(context(etcd.endpoint, 4))
    assert old.publish(record(10))          # round 4 open, no plan: round 3 drains and records
    client = EtcdClient(EtcdConfig((etcd.endpoint,), 2.0, 5.0))
    client.put(f"{PREFIX}rounds/4/plan", b"{}")
    assert not old.publish(record(12))      # round 4 closed: round 3 is fenced off
    assert new.publish(record(11))
    assert not new.publish(record(9))       # never backwards
    assert json.loads(client.get(f"{PREFIX}checkpoint/latest").value)["step"] == 11
    client.close()
