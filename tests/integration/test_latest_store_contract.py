"""One contract, two LatestStores: the in-memory store and the etcd store answer every
case alike. Decided: the same step with another sha256 is refused by both (two writers
disagree about one step; a rotten record is replaced through retract(), not overwritten),
and the identical record is accepted again (a retried save is idempotent)."""

from __future__ import annotations

import pytest

from elastic_runner.config import EtcdConfig
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.record_relay import RecordRelay, read_json
from elastic_runner.rendezvous.protocol import checkpoint_key
from elastic_runner.worker.checkpoint.etcd_store import EtcdLatestStore, RelayedLatestStore
from elastic_runner.worker.checkpoint.latest import NO_CHECKPOINT, MemoryLatestStore


def record(step: int, sha: str = "ab") -> dict:
    return {"url": f"file:///ckpt/step-{step}", "step": step, "sha256": sha * 32,
            "world_size": 2}


PREFIX = "/elastic-runner/v2/contract/"


@pytest.fixture(params=["memory", "etcd", "relayed"])
def store(request, tmp_path):
    """"relayed": reads through an agent's relay (record_relay.py) on another client,
    writes on the store's own: every read must see the write before it."""
    if request.param == "memory":
        yield MemoryLatestStore()
        return
    etcd = request.getfixturevalue("etcd")
    if request.param == "etcd":
        created = EtcdLatestStore((etcd.endpoint,), PREFIX, 0)
        yield created
        created.close()
        return
    agent_client = EtcdClient(EtcdConfig.build((etcd.endpoint,)))
    relay = RecordRelay.start(tmp_path, read_json(agent_client, checkpoint_key(PREFIX)))
    created = RelayedLatestStore(str(relay.path),
                                 lambda: EtcdLatestStore((etcd.endpoint,), PREFIX, 0))
    yield created
    created.close()
    relay.close()
    agent_client.close()


def test_empty_then_forward_only(store):
    assert store.read() is None
    assert store.publish(record(10))
    assert store.publish(record(20))
    assert not store.publish(record(15))
    assert store.read() == record(20)


def test_same_step_same_record_is_idempotent(store):
    assert store.publish(record(10))
    assert store.publish(record(10))
    assert store.read() == record(10)


def test_same_step_other_sha256_is_refused(store):
    assert store.publish(record(10, "ab"))
    assert not store.publish(record(10, "cd"))
    assert store.read() == record(10, "ab")


def test_retract_only_the_exact_bad_record(store):
    assert store.publish(record(20))
    assert not store.retract(record(20, "cd"), record(10))  # not what is there
    assert store.read() == record(20)
    assert store.retract(record(20), record(10))
    assert store.read() == record(10)
    assert not store.retract(record(20), record(10))  # a racing reader: already done
    assert store.publish(record(20, "ef"))  # the redone step is no longer fenced


def test_retract_to_no_checkpoint_fences_nothing(store):
    assert store.publish(record(20))
    assert store.retract(record(20), NO_CHECKPOINT)
    assert store.publish(record(0))
