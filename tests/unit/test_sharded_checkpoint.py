"""er.Checkpointer(sharded=True) in one process (a world-1 gloo group): what is
committed, skipped, pruned and refused, async durability, the other format, and the
runtime around it. Resharding across ranks: tests/integration/test_sharded_checkpoint.py."""

from __future__ import annotations

import errno
import json
import logging
import threading
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from elastic_runner.errors import (CheckpointError, CheckpointWriteError, EtcdFull,
                                   StaleWriterError)
from elastic_runner.events import read_jsonl
from elastic_runner.worker import job_checkpointer, runtime
from elastic_runner.worker.checkpoint import sharded_files
from elastic_runner.worker.checkpoint import storage as checkpoint_storage
from elastic_runner.worker.checkpoint.checkpointer import Checkpointer, MemoryLatestStore
from elastic_runner.worker.sampler import ElasticSampler
from elastic_runner.worker.state import State

LOGGER = "elastic_runner.worker.checkpoint.sharded"


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def objects(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    return {"model": model, "optim": optim, "sampler": ElasticSampler(40, global_batch_size=4)}


def train(objs: dict, steps: int = 1) -> None:
    for _ in range(steps):
        _, indices = next(iter(objs["sampler"]))
        objs["model"](torch.randn(len(indices), 4)).sum().backward()
        objs["optim"].step()
        objs["optim"].zero_grad()


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def same(a: dict, b: dict) -> bool:
    """Model, optimizer (state and hyper-parameters) and sampler position all equal."""
    return all(equal(a[name].state_dict(), b[name].state_dict()) for name in a)


def steps_on_disk(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def skips(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING]


def test_sharded_needs_a_process_group(tmp_path, monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # whatever ran before
    with pytest.raises(CheckpointError, match="needs a process group"):
        Checkpointer(tmp_path, sharded=True)
    standby = Checkpointer(tmp_path, sharded=True, rank=-1)  # no place yet (reform.py)
    assert standby.restore(objects()) is None
    with pytest.raises(CheckpointError, match="standby"):
        standby.save(1, objects())


def test_save_commits_a_manifest_last_and_restore_loads_every_object(group, tmp_path):
    store, saved = MemoryLatestStore(), objects()
    train(saved, 3)
    ckpt = Checkpointer(tmp_path, sharded=True, latest_store=store)
    url = ckpt.save(3, saved)
    manifest = json.loads((tmp_path / "step-00000003" / "MANIFEST.json").read_text())
    assert manifest["format"] == "sharded" and manifest["step"] == 3
    assert manifest["world_size"] == 1 and ".metadata" in manifest["files"]
    assert store.read() == {"url": url, "step": 3, "sha256": manifest["sha256"],
                            "world_size": 1, "format": "sharded"}
    fresh = objects(seed=1)
    assert Checkpointer(tmp_path, sharded=True, latest_store=store).restore(fresh) == 3
    assert same(fresh, saved)


def test_a_corrupt_shard_is_skipped_with_one_line_naming_it(group, tmp_path, caplog):
    store, objs = MemoryLatestStore(), objects()
    ckpt = Checkpointer(tmp_path, sharded=True, keep=None, latest_store=store)
    ckpt.save(10, objs)
    reference = objects(seed=2)
    ckpt.restore(reference)  # what step 10 holds
    train(objs)
    ckpt.save(20, objs)
    shard = tmp_path / "step-00000020" / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    caplog.set_level(logging.INFO)
    fresh = objects(seed=1)
    assert Checkpointer(tmp_path, sharded=True, latest_store=store).restore(fresh) == 10
    (line,) = skips(caplog)
    assert "step-00000020" in line and "__0_0.distcp" in line
    assert same(fresh, reference)
    assert store.read()["step"] == 10  # the rotten record no longer fences step 20


def test_an_incomplete_save_is_never_published_skipped_and_pruned_later(group, tmp_path,
                                                                      caplog):
    """What a rank killed mid-save leaves: DCP's shards, no manifest."""
    store, objs = MemoryLatestStore(), objects()
    ckpt = Checkpointer(tmp_path, sharded=True, keep=None, latest_store=store)
    ckpt.save(10, objs)
    dcp.save({"model": objs["model"].state_dict()}, checkpoint_id=tmp_path / "step-00000020")
    assert store.read()["step"] == 10
    caplog.set_level(logging.INFO)
    unrecorded = Checkpointer(tmp_path, sharded=True)  # no record: the scan sees step 20
    assert unrecorded.restore(objects(seed=1)) == 10
    (line,) = skips(caplog)
    assert "step-00000020" in line and "no MANIFEST.json" in line
    caplog.clear()  # with the record (step 10), step 20 is not a candidate: said once
    recorded = Checkpointer(tmp_path, sharded=True, latest_store=store)
    assert recorded.restore(objects(seed=1)) == 10
    ignored = [r.getMessage() for r in caplog.records if "ignoring checkpoint" in r.getMessage()]
    assert len(ignored) == 1 and "step-00000020" in ignored[0] and "never published" in ignored[0]
    ckpt.save(30, objs)
    assert steps_on_disk(tmp_path) == ["step-00000010", "step-00000030"]


def test_keep_prunes_only_verified_checkpoints_never_newer_ones(group, tmp_path):
    objs = objects()
    ckpt = Checkpointer(tmp_path, sharded=True, keep=2, latest_store=MemoryLatestStore())
    for step in (10, 20):
        ckpt.save(step, objs)
    (tmp_path / "step-00000025").mkdir()  # a writer killed before its first byte
    (tmp_path / "step-00000050").mkdir()  # maybe a newer writer's: not ours to judge
    for step in (30, 40):
        ckpt.save(step, objs)
    assert steps_on_disk(tmp_path) == ["step-00000030", "step-00000040", "step-00000050"]


def test_async_save_snapshots_at_save_and_counts_once_waited(group, tmp_path, monkeypatch):
    store, objs = MemoryLatestStore(), objects()
    train(objs, 2)
    snapshot = objects(seed=3)
    Checkpointer(tmp_path / "copy", sharded=True).save(2, objs)
    Checkpointer(tmp_path / "copy", sharded=True).restore(snapshot)
    gate, write = threading.Event(), sharded_files._Recording.write_data

    def gated(self, plan, planner):
        assert gate.wait(30)
        return write(self, plan, planner)

    monkeypatch.setattr(sharded_files._Recording, "write_data", gated)
    ckpt = Checkpointer(tmp_path / "ckpt", sharded=True, async_save=True, latest_store=store)
    ckpt.save(2, objs)
    train(objs, 3)  # training goes on before the write has begun
    assert store.read() is None
    gate.set()
    ckpt.wait()
    assert store.read()["step"] == 2
    fresh = objects(seed=1)
    assert Checkpointer(tmp_path / "ckpt", sharded=True, latest_store=store).restore(fresh) == 2
    assert same(fresh, snapshot)
    ckpt.close()


def disk_full_on_manifest(monkeypatch) -> None:
    original = checkpoint_storage._write_all

    def write(fileobj, data):
        if "MANIFEST" in str(fileobj.name):
            raise OSError(errno.ENOSPC, "No space left on device")
        original(fileobj, data)

    monkeypatch.setattr(checkpoint_storage, "_write_all", write)


def test_a_failed_async_save_is_raised_by_the_next_call_and_never_recorded(group, tmp_path,
                                                                          monkeypatch):
    store, objs = MemoryLatestStore(), objects()
    ckpt = Checkpointer(tmp_path, sharded=True, async_save=True, latest_store=store)
    ckpt.save(1, objs)
    ckpt.wait()
    disk_full_on_manifest(monkeypatch)
    ckpt.save(2, objs)
    with pytest.raises(CheckpointWriteError, match="step 2.*No space left"):
        ckpt.save(3, objs)  # reported here; step 3 is not started
    assert store.read()["step"] == 1
    assert not (tmp_path / "step-00000003").exists()
    monkeypatch.undo()
    ckpt.save(4, objs)
    ckpt.close()
    assert store.read()["step"] == 4
    assert "step-00000002" not in steps_on_disk(tmp_path)  # the uncommitted one is gone


class FullStore(MemoryLatestStore):
    """Reads answer; while `full`, every publish raises as etcd past its quota does."""

    full = False

    def publish(self, record):
        if self.full:
            raise EtcdFull("etcd at 127.0.0.1:1 is full and refused a transaction")
        return super().publish(record)


def test_a_save_etcd_cannot_record_is_kept_untidied_and_the_next_one_records(group,
                                                                            tmp_path):
    """pending_record.py: training goes on through a full etcd; the recorded step's
    shards survive keep=1 until a newer save is recorded; an unrecorded last save is
    one clear error at close."""
    store, objs = FullStore(), objects()
    ckpt = Checkpointer(tmp_path, sharded=True, keep=1, latest_store=store)
    ckpt.save(1, objs)
    store.full = True
    train(objs)
    ckpt.save(2, objs)  # no error
    assert store.read()["step"] == 1
    assert steps_on_disk(tmp_path) == ["step-00000001", "step-00000002"]
    fresh = objects(seed=5)
    assert Checkpointer(tmp_path, sharded=True, latest_store=store).restore(fresh) == 1
    store.full = False
    train(objs)
    ckpt.save(3, objs)
    assert store.read()["step"] == 3 and steps_on_disk(tmp_path) == ["step-00000003"]
    store.full = True
    ckpt.save(4, objs)
    with pytest.raises(CheckpointError, match="step 4 .*never recorded"):
        ckpt.close()
    assert store.read()["step"] == 3


def test_a_second_run_saving_shards_into_the_folder_is_refused(group, tmp_path):
    """folder_claim.py in the sharded format: refused on every rank before DCP writes."""
    objs = objects()
    first = Checkpointer(tmp_path, sharded=True, latest_store=MemoryLatestStore(),
                         run_id="run-a")
    first.save(10, objs)
    manifest = json.loads((tmp_path / "step-00000010" / "MANIFEST.json").read_text())
    assert manifest["run_id"] == "run-a"
    second = Checkpointer(tmp_path, sharded=True, latest_store=MemoryLatestStore(),
                          run_id="run-b")
    with pytest.raises(CheckpointError, match="holds step 10 of run 'run-a'"):
        second.save(10, objs)
    assert json.loads((tmp_path / "step-00000010" / "MANIFEST.json").read_text()) == manifest
    fresh = objects(seed=4)
    assert second.restore(fresh) == 10  # it resumes from that run's step: then it may save
    second.save(20, fresh)
    assert steps_on_disk(tmp_path) == ["step-00000010", "step-00000020"]


def test_a_recorded_step_missing_from_a_ranks_folder_is_an_error_not_rot(group, tmp_path):
    """verdicts.absent_recorded_step: a rank that reads another folder than the writer
    (a node-local path) fails with one line naming it; nothing is retracted."""
    store, objs = MemoryLatestStore(), objects()
    Checkpointer(tmp_path / "node-a", sharded=True, latest_store=store).save(10, objs)
    record = store.read()
    reader = Checkpointer(tmp_path / "node-b", sharded=True, latest_store=store)
    with pytest.raises(CheckpointError, match=r"step 10 \(.*node-a/step-00000010\), is not in "
                                              r"the checkpoint folder .*node-b as rank 0 sees"):
        reader.restore(objects(seed=2))
    assert store.read() == record


def test_a_recorded_step_storage_cannot_read_now_fails_the_restore(group, tmp_path,
                                                                   monkeypatch):
    """verdicts.unreadable_recorded_step: every rank raises, nothing is retracted."""
    store, objs = MemoryLatestStore(), objects()
    ckpt = Checkpointer(tmp_path, sharded=True, keep=None, latest_store=store)
    ckpt.save(10, objs)
    ckpt.save(20, objs)
    record = store.read()
    original = sharded_files.check_file

    def flaky(storage, directory, name, entry):
        if directory.endswith("step-00000020"):
            raise sharded_files.Unreadable(f"cannot read {name}: [Errno 5] Input/output error")
        return original(storage, directory, name, entry)

    monkeypatch.setattr(sharded_files, "check_file", flaky)
    with pytest.raises(CheckpointError, match="cannot read the checkpoint recorded for this "
                                              "run, step 20 .*Input/output error"):
        Checkpointer(tmp_path, sharded=True, latest_store=store).restore(objects(seed=3))
    assert store.read() == record
    monkeypatch.undo()
    assert Checkpointer(tmp_path, sharded=True, latest_store=store).restore(objects(3)) == 20


def test_a_stale_writer_is_refused_before_it_writes_anything(group, tmp_path):
    store = MemoryLatestStore({"url": "x", "step": 50, "sha256": "ab", "world_size": 4})
    ckpt = Checkpointer(tmp_path, sharded=True, latest_store=store)
    with pytest.raises(StaleWriterError, match="step 40"):
        ckpt.save(40, objects())
    assert steps_on_disk(tmp_path) == []


def test_a_checkpoint_of_the_other_format_is_one_clear_error_and_never_deleted(group,
                                                                              tmp_path):
    Checkpointer(tmp_path / "plain").save(5, {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match="sharded=False"):
        Checkpointer(tmp_path / "plain", sharded=True).restore(objects())
    Checkpointer(tmp_path / "shards", sharded=True).save(5, objects())
    with pytest.raises(CheckpointError, match="sharded=True"):
        Checkpointer(tmp_path / "shards").load_latest()
    Checkpointer(tmp_path / "shards", keep=1).save(9, {"w": torch.ones(2)})  # its tidy
    assert steps_on_disk(tmp_path / "shards") == ["step-00000005", "step-00000009"]
    with pytest.raises(CheckpointError, match=r"call restore\("):
        Checkpointer(tmp_path / "x", sharded=True).load_latest()


# ---- the runtime: er.Checkpointer, resizes, er.State -------------------------------------
@pytest.fixture
def context(tmp_path, monkeypatch):
    ctx = runtime.context_from_env({"ELASTIC_RUN_EVENTS_PATH": str(tmp_path / "events.jsonl"),
                                    "ELASTIC_RUN_ROUND": "2"}, "gloo", "cpu")
    monkeypatch.setattr(runtime, "_active", [ctx])
    return ctx


@pytest.mark.parametrize("sharded", [False, True])
def test_one_flag_switches_the_format_of_the_same_script(group, context, tmp_path, sharded):
    objs = objects()
    train(objs, 2)
    ckpt = job_checkpointer.Checkpointer(tmp_path, sharded=sharded, keep=3, every=2)
    assert ckpt.restore(objs) is None
    assert ckpt.due(2)
    assert ckpt.save(2, objs) == f"file://{tmp_path}/step-00000002"
    ckpt.close()
    fresh = objects(seed=1)
    state = State(**fresh)
    assert state.restore(job_checkpointer.Checkpointer(tmp_path, sharded=sharded)) == 2
    assert state.step == 2 and same(fresh, objs)
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "events.jsonl")]
    assert kinds == ["checkpoint_saved", "checkpoint_loaded"]


def test_a_resize_saves_the_registered_step_on_every_rank(group, context, tmp_path):
    objs = objects()
    ckpt = job_checkpointer.Checkpointer(tmp_path, sharded=True, async_save=True)
    ckpt.restore(objs)  # registers the objects
    train(objs, 3)
    assert ckpt.save_for_resize(3)
    fresh = objects(seed=1)
    assert job_checkpointer.Checkpointer(tmp_path, sharded=True).restore(fresh) == 3
    assert same(fresh, objs)
    ckpt.close()


def test_an_fsspec_url_takes_the_same_path(group):
    """Object stores go through DCP's fsspec writer and reader (memory:// here)."""
    url, store, objs = f"memory://sharded-{uuid.uuid4().hex[:8]}", MemoryLatestStore(), objects()
    train(objs, 2)
    ckpt = Checkpointer(url, sharded=True, async_save=True, latest_store=store)
    ckpt.save(2, objs)
    ckpt.close()
    assert store.read()["url"] == f"{url.replace('://', ':///')}/step-00000002"
    fresh = objects(seed=1)
    assert Checkpointer(url, sharded=True, latest_store=store).restore(fresh) == 2
    assert same(fresh, objs)
