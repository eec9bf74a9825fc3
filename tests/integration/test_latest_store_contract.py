"""One contract, two LatestStores: the in-memory store and the etcd store answer every
case alike. Decided: the same step with another sha256 is refused by both (two writers
disagree about one step; a rotten record is replaced through retract(), not overwritten),
and the identical record is accepted again (a retried save is idempotent)."""

from __future__ import annotations

import pytest

from elastic_runner.worker.checkpoint.etcd_store import EtcdLatestStore
from elastic_runner.worker.checkpoint.latest import NO_CHECKPOINT, MemoryLatestStore


def record(step: int, sha: str = "ab") -> dict:
    return {"url": f"file:///ckpt/step-{step}", "step": step, "sha256": sha * 32,
            "world_size": 2}


@pytest.fixture(params=["memory", "etcd"])
def store(request):
    if request.param == "memory":
        yield MemoryLatestStore()
        return
    etcd = request.getfixturevalue("etcd")
    created = EtcdLatestStore((etcd.endpoint,), "/elastic-runner/v2/contract/", 0)
    yield created
    created.close()


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
