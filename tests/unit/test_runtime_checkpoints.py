"""The worker runtime around checkpoints: leaving waits for every save and fails
on a lost one; events and metrics say "saved" only when it is durable."""

from __future__ import annotations

import errno
import json
import logging
import threading

import pytest
import torch

from elastic_runner.worker import job_checkpointer, runtime
from elastic_runner.worker.checkpoint import storage as checkpoint_storage
from elastic_runner.worker.checkpoint.checkpointer import MemoryLatestStore
from elastic_runner.errors import CheckpointError, CheckpointWriteError, StaleWriterError
from elastic_runner.events import read_jsonl
from tests.helpers.gates import gate_storage_writes


@pytest.fixture
def context(tmp_path, monkeypatch):
    """The process's one context, as init() would leave it (no process group)."""
    progress = tmp_path / "progress"
    progress.mkdir()
    ctx = runtime.context_from_env({"ELASTIC_RUN_EVENTS_PATH": str(tmp_path / "events.jsonl"),
                                    "ELASTIC_RUN_PROGRESS_DIR": str(progress),
                                    "ELASTIC_RUN_ROUND": "3"}, "gloo", "cpu")
    monkeypatch.setattr(runtime, "_active", [ctx])
    return ctx


def disk_full_for(monkeypatch, step: int) -> None:
    original = checkpoint_storage._write_all

    def write(fileobj, data):
        if f"step-{step:08d}" in str(fileobj.name):
            raise OSError(errno.ENOSPC, "No space left on device")
        original(fileobj, data)

    monkeypatch.setattr(checkpoint_storage, "_write_all", write)


def saved_steps(tmp_path) -> list[int]:
    return [e["step"] for e in read_jsonl(tmp_path / "events.jsonl")
            if e["kind"] == "checkpoint_saved"]


def test_finish_waits_for_every_checkpointer_and_raises_the_failure(context, tmp_path,
                                                                   monkeypatch):
    disk_full_for(monkeypatch, 20)
    good = job_checkpointer.Checkpointer(tmp_path / "good", async_save=True,
                                latest_store=MemoryLatestStore())
    bad = job_checkpointer.Checkpointer(tmp_path / "bad", async_save=True)
    good.save(10, {"w": torch.ones(3)})
    bad.save(20, {"w": torch.ones(3)})
    with pytest.raises(CheckpointWriteError, match="step 20") as info:
        runtime.finish()
    assert "No space left on device" in str(info.value)
    assert runtime.current() is None and context.checkpointers == []
    assert (tmp_path / "good" / "step-00000010" / "MANIFEST.json").exists()
    assert saved_steps(tmp_path) == [10]  # the good one only
    runtime.finish()  # nothing left: a second finish is quiet


def test_leaving_the_with_block_fails_on_a_lost_save(context, tmp_path, monkeypatch):
    disk_full_for(monkeypatch, 7)
    with pytest.raises(CheckpointWriteError, match="step 7"):
        with context:
            job_checkpointer.Checkpointer(tmp_path, async_save=True).save(7, {"w": torch.ones(1)})
    assert runtime.current() is None


def test_sys_exit_0_inside_the_block_does_not_hide_a_lost_save(context, tmp_path, monkeypatch):
    disk_full_for(monkeypatch, 7)
    with pytest.raises(CheckpointWriteError):
        with context:
            job_checkpointer.Checkpointer(tmp_path, async_save=True).save(7, {"w": torch.ones(1)})
            raise SystemExit(0)


def test_the_blocks_own_error_wins_and_the_lost_save_is_logged(context, tmp_path, monkeypatch,
                                                              caplog):
    disk_full_for(monkeypatch, 7)
    caplog.set_level(logging.ERROR, logger="elastic_runner.worker.runtime")
    with pytest.raises(ZeroDivisionError):
        with context:
            job_checkpointer.Checkpointer(tmp_path, async_save=True).save(7, {"w": torch.ones(1)})
            1 / 0
    assert any("step 7" in r.getMessage() for r in caplog.records)


def test_async_checkpoint_saved_comes_from_the_completed_write(context, tmp_path, monkeypatch):
    gate = gate_storage_writes(monkeypatch)
    store = MemoryLatestStore()
    ckpt = job_checkpointer.Checkpointer(tmp_path / "ckpt", async_save=True, latest_store=store)
    ckpt.save(10, {"w": torch.ones(2)})
    assert saved_steps(tmp_path) == [] and not (tmp_path / "progress" / "checkpoint.json").exists()
    gate.set()
    ckpt.wait()
    (event,) = [e for e in read_jsonl(tmp_path / "events.jsonl")]
    assert event["kind"] == "checkpoint_saved" and event["step"] == 10 and event["round"] == 3
    assert event["url"] == store.read()["url"]
    progress = json.loads((tmp_path / "progress" / "checkpoint.json").read_text())
    assert progress["step"] == 10 and progress["url"] == event["url"]
    assert [p.name for p in (tmp_path / "progress").iterdir()] == ["checkpoint.json"]


def test_a_failed_sync_save_is_not_announced(context, tmp_path, monkeypatch):
    disk_full_for(monkeypatch, 5)
    ckpt = job_checkpointer.Checkpointer(tmp_path / "ckpt")
    ckpt.save(4, {"w": torch.ones(1)})
    with pytest.raises(CheckpointWriteError):
        ckpt.save(5, {"w": torch.ones(1)})
    assert saved_steps(tmp_path) == [4]


@pytest.mark.parametrize("in_place", [True, False], ids=["er.elastic", "restart-path"])
def test_a_refused_save_ends_only_a_worker_that_cannot_re_form_in_place(
        context, tmp_path, caplog, in_place):
    """A round can close while rank 0 saves the step in flight: the record is fenced.
    Under er.elastic the worker outlives its round and its peers hold the state, so the
    refusal is a warning and the step goes on to its boundary; on the restart path the
    worker must stop (its round is over) and the error says so."""
    store = MemoryLatestStore({"url": "elsewhere", "step": 50, "sha256": "0" * 64,
                               "world_size": 2})  # the next round's record
    ckpt = job_checkpointer.Checkpointer(tmp_path / "ckpt", latest_store=store)
    if in_place:
        context.boundary.pause_asked = lambda: False  # what elastic.Reformer attaches
    caplog.set_level(logging.WARNING, logger="elastic_runner.worker.runtime")
    if not in_place:
        with pytest.raises(StaleWriterError, match="step 40 .*Stop this worker") as info:
            ckpt.save(40, {"w": torch.ones(1)})
        assert info.value.step == 40
    else:
        assert ckpt.save(40, {"w": torch.ones(1)}) is None
        (line,) = [r.getMessage() for r in caplog.records if "not recorded" in r.getMessage()]
        assert line.startswith("checkpoint step 40 not recorded") and "er.elastic" in line
    assert store.read()["step"] == 50 and saved_steps(tmp_path) == []
    assert ckpt.save(60, {"w": torch.ones(1)}) is not None  # a newer step is recorded
    assert store.read()["step"] == 60 and saved_steps(tmp_path) == [60]


class ClosingStore(MemoryLatestStore):
    """The record store a Checkpointer opens itself (an etcd client in a worker)."""

    def __init__(self):
        super().__init__()
        self.closed = 0

    def publish(self, record: dict) -> bool:
        assert not self.closed, "published after the store was closed"
        return super().publish(record)

    def close(self) -> None:
        self.closed += 1


def test_finish_closes_the_record_store_the_checkpointer_opened_after_its_last_save(
        tmp_path, monkeypatch):
    """No gRPC channel is left to the interpreter's teardown (job_checkpointer.close)."""
    ctx = runtime.context_from_env({"ELASTIC_RUN_ROUND": "3",
                                    "ELASTIC_RUN_ETCD_ENDPOINTS": "http://127.0.0.1:1"},
                                   "gloo", "cpu")
    monkeypatch.setattr(runtime, "_active", [ctx])
    opened = []
    monkeypatch.setattr(job_checkpointer, "_etcd_store",
                        lambda context, writer: opened.append(ClosingStore()) or opened[-1])
    gate = gate_storage_writes(monkeypatch)
    ckpt = job_checkpointer.Checkpointer(tmp_path / "ckpt", async_save=True, rank=0)
    given = job_checkpointer.Checkpointer(tmp_path / "given", latest_store=ClosingStore(),
                                          rank=0)
    ckpt.save(10, {"w": torch.ones(3)})  # still writing when finish() begins
    threading.Timer(0.2, gate.set).start()
    runtime.finish()
    (store,) = opened
    assert store.closed == 1 and store.read()["step"] == 10  # published, then closed
    assert given._latest.closed == 0  # a store the script passed in is the script's
    ckpt.close()
    assert store.closed == 1


def test_a_second_folder_recording_in_etcd_is_refused_at_construction(tmp_path, monkeypatch):
    """etcd keeps one record of a run's newest checkpoint: two er.Checkpointers on two
    folders (model and EMA, say) published into it, a save of a step the other had
    recorded was refused as a 'stale writer', and each loaded the other's steps."""
    ctx = runtime.context_from_env({"ELASTIC_RUN_ROUND": "3",
                                    "ELASTIC_RUN_ETCD_ENDPOINTS": "http://127.0.0.1:1"},
                                   "gloo", "cpu")
    monkeypatch.setattr(runtime, "_active", [ctx])
    monkeypatch.setattr(job_checkpointer, "_etcd_store", lambda context, writer: ClosingStore())
    model = job_checkpointer.Checkpointer(tmp_path / "model", rank=0)
    with pytest.raises(CheckpointError, match=r"already records its checkpoints in etcd from "
                                              r"file://.*/model.* second er.Checkpointer on "
                                              r"file://.*/ema cannot have one too"):
        job_checkpointer.Checkpointer(tmp_path / "ema", rank=0)
    assert not (tmp_path / "ema").exists()  # refused before it probed the folder
    again = job_checkpointer.Checkpointer(str(tmp_path / "model") + "/", rank=0)  # same folder
    aside = job_checkpointer.Checkpointer(tmp_path / "ema", rank=0,
                                          latest_store=MemoryLatestStore())
    aside.save(5, {"w": torch.ones(2)})
    model.close()
    again.close()
    job_checkpointer.Checkpointer(tmp_path / "other", rank=0).close()  # the others are closed
    runtime.finish()


def test_a_second_checkpointer_on_the_same_folder_retires_the_first(tmp_path, context):
    """A model's and an EMA's Checkpointer on one folder: before, both wrote step-N, the
    later replacing the earlier, so the model's step 20 held only the EMA."""
    folder = tmp_path / "ckpt"
    model = job_checkpointer.Checkpointer(folder, rank=0)
    model.save(10, {"model": torch.full((2,), 1.0)})
    (tmp_path / "link").symlink_to(folder)
    ema = job_checkpointer.Checkpointer(tmp_path / "link", rank=0)  # the same folder
    with pytest.raises(CheckpointError) as refused:
        model.save(20, {"model": torch.full((2,), 2.0)})
    message = str(refused.value)
    assert "\n" not in message and "replaced by a newer one made on the same folder" in message
    assert "save(step, {'model': ..., 'ema': ...})" in message
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step")) == \
        ["step-00000010"]  # refused before anything was written
    ema.save(20, {"ema": torch.full((2,), 3.0)})
    reader = job_checkpointer.Checkpointer(folder, rank=1)  # retires ema, which saves no more
    assert reader.load_latest()["ema"].tolist() == [3.0, 3.0]
    assert context.checkpointers == [reader]
    runtime.finish()


def test_a_checkpointer_made_again_on_its_folder_saves_on(tmp_path, context):
    """A script that makes its Checkpointer again (inside train(), called again after a
    re-formation) never saves through the older one: nothing fails."""
    for step in (10, 20, 30):
        ckpt = job_checkpointer.Checkpointer(tmp_path / "ckpt", rank=0, async_save=True)
        ckpt.save(step, {"w": torch.full((2,), float(step))})
    assert len(context.checkpointers) == 1
    runtime.finish()
    assert job_checkpointer.Checkpointer(tmp_path / "ckpt", rank=1).load_latest()["w"].tolist() \
        == [30.0, 30.0]
