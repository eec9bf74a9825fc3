"""Issue 12's checkpoint-trust rules, in process: async failures are never lost,
a rotten published record stops fencing, leftovers go at the next good save."""

from __future__ import annotations

import errno
import logging

import pytest
import torch

from elastic_runner.worker.checkpoint import storage as checkpoint_storage
from elastic_runner.worker.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointError,
    CheckpointWriteError,
    MemoryLatestStore,
    StaleWriterError,
)
from elastic_runner.worker.checkpoint.latest import NO_CHECKPOINT
from tests.helpers.gates import gate_storage_writes

LOGGER = "elastic_runner.worker.checkpoint.checkpointer"


def payload(step: int, variant: float = 0.0) -> dict:
    return {"step": step, "w": torch.full((8,), float(step) + variant)}


def step_dirs(root) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step-"))


def flip_a_byte(root, step: int) -> None:
    state = root / f"step-{step:08d}" / "state.pt"
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    state.write_bytes(bytes(raw))


def disk_full_for(monkeypatch, *steps: int) -> None:
    """Writes under these step directories fail half-way with ENOSPC."""
    original = checkpoint_storage._write_all

    def write(fileobj, data):
        if any(f"step-{s:08d}" in str(fileobj.name) for s in steps):
            fileobj.write(memoryview(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        original(fileobj, data)

    monkeypatch.setattr(checkpoint_storage, "_write_all", write)


class Recording(Checkpointer):
    """Notes what the latest store held when the runtime's hook would log the save."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.saved: list[tuple[int, int | None]] = []

    def _saved(self, step, url, duration_s):
        record = self._latest.read() if self._latest is not None else None
        self.saved.append((step, record and record["step"]))


# ---- 1. async saves: failures surface, successes are announced only when durable ----
def test_async_failure_surfaces_at_the_next_due(tmp_path, monkeypatch):
    disk_full_for(monkeypatch, 20)
    ckpt = Recording(tmp_path, async_save=True, every=10)
    ckpt.save(10, payload(10))
    ckpt.save(20, payload(20))
    ckpt.load_latest()  # lets the write finish; its error is kept for the training thread
    with pytest.raises(CheckpointWriteError, match="step 20") as info:
        ckpt.due(21)
    assert "No space left on device" in str(info.value) and "\n" not in str(info.value)
    assert not ckpt.due(21)  # reported once
    ckpt.close()
    assert step_dirs(tmp_path) == [10] and ckpt.saved == [(10, None)]


def test_a_save_failing_while_another_is_requested(tmp_path, monkeypatch):
    disk_full_for(monkeypatch, 1)
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, payload(1))
    with pytest.raises(CheckpointWriteError, match="step 1"):
        ckpt.save(2, payload(2))  # names the failed save; this one does not start
    assert step_dirs(tmp_path) == []
    ckpt.close()
    ckpt.close()


def test_close_raises_a_pending_failure_once(tmp_path, monkeypatch):
    disk_full_for(monkeypatch, 5)
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt.save(5, payload(5))
    with pytest.raises(CheckpointWriteError, match="step 5"):
        ckpt.close()
    ckpt.close()  # the second close does nothing
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.save(6, payload(6))


def test_an_unexpected_async_error_is_a_checkpoint_error_naming_the_step(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt.save(3, {"f": lambda: None})  # torch.save cannot pickle it
    with pytest.raises(CheckpointWriteError, match="async save of checkpoint step 3 failed"):
        ckpt.wait()
    ckpt.close()


def test_saved_hook_runs_only_once_verified_and_published(tmp_path, monkeypatch):
    gate = gate_storage_writes(monkeypatch)
    store = MemoryLatestStore()
    ckpt = Recording(tmp_path, async_save=True, latest_store=store)
    ckpt.save(4, payload(4))
    assert ckpt.saved == []  # submitted is not saved
    gate.set()
    ckpt.close()
    assert ckpt.saved == [(4, 4)]  # the record was already in the store


def test_fenced_or_failed_saves_are_never_announced(tmp_path, monkeypatch):
    store = MemoryLatestStore({"url": "x", "step": 50, "sha256": "a", "world_size": 1})
    ckpt = Recording(tmp_path, latest_store=store)
    with pytest.raises(StaleWriterError):
        ckpt.save(40, payload(40))
    disk_full_for(monkeypatch, 60)
    with pytest.raises(CheckpointWriteError):
        ckpt.save(60, payload(60))
    assert ckpt.saved == []


# ---- 2. a published checkpoint that rots stops fencing ---------------------------------
def published(tmp_path, *steps: int) -> MemoryLatestStore:
    store = MemoryLatestStore()
    writer = Checkpointer(tmp_path, keep=None, latest_store=store)
    for step in steps:
        writer.save(step, payload(step))
    return store


def test_rotten_record_is_replaced_by_the_fallback_and_the_steps_are_redone(tmp_path):
    store = published(tmp_path, 10, 20)
    flip_a_byte(tmp_path, 20)
    restarted = Checkpointer(tmp_path, latest_store=store)
    assert restarted.load_latest()["step"] == 10
    record = store.read()
    assert record["step"] == 10 and record["url"].endswith("step-00000010")
    for step in (15, 20):  # refused as "fenced" before the fix
        restarted.save(step, payload(step, variant=0.5))
    assert store.read()["step"] == 20
    assert torch.equal(Checkpointer(tmp_path, rank=1, latest_store=store).load_latest()["w"],
                       payload(20, variant=0.5)["w"])


def test_only_rank_0_retracts_and_racing_readers_agree(tmp_path):
    store = published(tmp_path, 10, 20)
    flip_a_byte(tmp_path, 20)
    bad = store.read()
    assert Checkpointer(tmp_path, rank=1, latest_store=store).load_latest()["step"] == 10
    assert store.read() == bad  # another rank falls back but leaves the record alone
    first, second = (Checkpointer(tmp_path, latest_store=store) for _ in range(2))
    assert first.load_latest()["step"] == second.load_latest()["step"] == 10
    assert store.read()["step"] == 10
    assert not store.retract(bad, NO_CHECKPOINT)  # the record is no longer the bad one


def test_nothing_older_verifies_leaves_a_record_that_names_no_checkpoint(tmp_path, caplog):
    store = published(tmp_path, 20)
    Checkpointer(tmp_path, keep=None).save(30, payload(30))  # verified, never published
    flip_a_byte(tmp_path, 20)
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert Checkpointer(tmp_path, latest_store=store).load_latest() is None
    assert store.read() == NO_CHECKPOINT
    assert any("names no checkpoint" in r.getMessage() for r in caplog.records)
    # A rank reading after the swap agrees with rank 0 instead of taking step 30.
    assert Checkpointer(tmp_path, rank=1, latest_store=store).load_latest() is None
    Checkpointer(tmp_path, latest_store=store).save(5, payload(5))
    assert store.read()["step"] == 5


def test_a_store_without_retract_says_saves_will_be_refused(tmp_path, caplog):
    class Minimal:
        def __init__(self, record):
            self.record = record

        def read(self):
            return self.record

        def publish(self, record):
            return False

    store = published(tmp_path, 10, 20)
    flip_a_byte(tmp_path, 20)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    Checkpointer(tmp_path, latest_store=Minimal(store.read())).load_latest()
    assert any("cannot retract" in r.getMessage() for r in caplog.records)


def test_memory_store_retracts_only_the_exact_bad_record():
    record = {"url": "u", "step": 7, "sha256": "a", "world_size": 2}
    store = MemoryLatestStore(record)
    assert not store.retract({**record, "sha256": "b"}, NO_CHECKPOINT)
    assert store.retract(dict(record), NO_CHECKPOINT) and store.read() == NO_CHECKPOINT
    assert store.publish({**record, "step": 0})  # NO_CHECKPOINT fences nothing


# ---- 3. leftovers go at the next successful save ----------------------------------------
TMP = "state.pt.tmp-0123456789ab"


def test_next_save_removes_temporaries_and_unverified_steps_below_it(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=3)
    for step in (1, 2, 3):
        ckpt.save(step, payload(step))
    (tmp_path / "step-00000003" / TMP).write_bytes(b"half")   # killed re-write of step 3
    (tmp_path / "step-00000003" / "notes.txt").write_text("not ours")
    (tmp_path / "step-00000002" / "MANIFEST.json").unlink()   # uncommitted
    flip_a_byte(tmp_path, 1)                                  # rotten
    (tmp_path / "step-00000004").mkdir()                      # killed first write of step 4
    (tmp_path / "step-00000004" / TMP).write_bytes(b"half")
    (tmp_path / "step-00000009").mkdir()                      # above the save: untouched
    (tmp_path / "step-00000009" / TMP).write_bytes(b"half")
    Checkpointer(tmp_path, keep=3).save(5, payload(5))  # a restarted writer hashes afresh
    assert step_dirs(tmp_path) == [3, 5, 9]
    assert sorted(p.name for p in (tmp_path / "step-00000003").iterdir()) == [
        "MANIFEST.json", "notes.txt", "state.pt"]
    assert (tmp_path / "step-00000009" / TMP).exists()


def test_the_saved_step_is_kept_whatever_it_holds(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(1, payload(1))
    (tmp_path / "step-00000002").mkdir()
    (tmp_path / "step-00000002" / TMP).write_bytes(b"killed writer of step 2")
    ckpt.save(2, payload(2))  # over the debris
    assert step_dirs(tmp_path) == [2]
    assert sorted(p.name for p in (tmp_path / "step-00000002").iterdir()) == [
        "MANIFEST.json", "state.pt"]


def eio_on_reads_of(monkeypatch, ckpt: Checkpointer, fragment: str) -> None:
    """Storage answers EIO for paths holding `fragment`, as a network filesystem may."""
    fs, original = ckpt._storage.fs, ckpt._storage.fs.cat_file

    def flaky(path, *args, **kwargs):
        if fragment in path:
            raise OSError(errno.EIO, "Input/output error")
        return original(path, *args, **kwargs)

    monkeypatch.setattr(fs, "cat_file", flaky)


def test_a_step_that_cannot_be_read_now_is_not_deleted(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(1, payload(1))
    eio_on_reads_of(monkeypatch, ckpt, "step-00000001")
    ckpt.save(2, payload(2))
    assert step_dirs(tmp_path) == [1, 2]  # maybe transient: left for the next save


def test_the_newest_verified_step_survives_a_save_below_it(tmp_path):
    store = published(tmp_path, 10, 20)
    Checkpointer(tmp_path, keep=None).save(30, payload(30))  # verified, never published
    flip_a_byte(tmp_path, 20)
    ckpt = Checkpointer(tmp_path, keep=1, latest_store=store)
    assert ckpt.load_latest()["step"] == 10
    ckpt.save(15, payload(15))
    assert step_dirs(tmp_path) == [15, 20, 30]  # 10 beyond keep; 20 and 30 above the save


@pytest.mark.parametrize("rank", [0, 1], ids=["the-new-writer", "a-reader"])
def test_a_recorded_step_missing_from_this_folder_is_an_error_not_rot(tmp_path, rank):
    """Another node's folder (a node-local path), or a changed --checkpoint-dir: the
    recorded checkpoint is not there at all. Before, this rank skipped it and started
    from what its own folder held (here step 5, or nothing) while the writer's node
    resumed from step 20, and rank 0 retracted the record for everyone."""
    store = MemoryLatestStore()
    writer = Checkpointer(tmp_path / "node-a", latest_store=store)
    writer.save(10, payload(10))
    writer.save(20, payload(20))
    record = store.read()
    Checkpointer(tmp_path / "node-b").save(5, payload(5))  # this node's own older step
    reader = Checkpointer(tmp_path / "node-b", rank=rank, latest_store=store)
    with pytest.raises(CheckpointError) as missing:
        reader.load_latest()
    line = str(missing.value)
    assert f"step 20 ({record['url']}), is not in the checkpoint folder" in line
    assert "node-b as this rank sees it" in line and "a node-local path works on one node" \
        in line and "\n" not in line
    assert store.read() == record  # nothing retracted
    assert step_dirs(tmp_path / "node-b") == [5] and step_dirs(tmp_path / "node-a") == [10, 20]


def test_a_recorded_step_storage_cannot_read_now_fails_the_load_and_retracts_nothing(
        tmp_path, monkeypatch):
    """A passing storage error (EIO from a network filesystem) on the recorded step used
    to be skipped as rot: rank 0 retracted a good record and resumed from an older step,
    while ranks that read it fine resumed from the newer one."""
    store = MemoryLatestStore()
    writer = Checkpointer(tmp_path, keep=None, latest_store=store)
    writer.save(10, payload(10))
    writer.save(20, payload(20))
    record = store.read()
    reader = Checkpointer(tmp_path, latest_store=store)
    eio_on_reads_of(monkeypatch, reader, "step-00000020/state.pt")
    with pytest.raises(CheckpointError, match=r"cannot read the checkpoint recorded for this "
                                              r"run, step 20 .*Input/output error.*Nothing "
                                              r"was retracted"):
        reader.load_latest()
    assert store.read() == record
    monkeypatch.undo()
    assert reader.load_latest()["step"] == 20  # the restart reads it
