"""Outcome tests for elastic_runner.worker.checkpoint.checkpointer: what survives crashes and races."""

from __future__ import annotations

import errno
import json
import re
import logging
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_runner.worker.checkpoint import storage as checkpoint_storage
from elastic_runner.worker.checkpoint.checkpointer import (
    CheckpointError,
    Checkpointer,
    CheckpointWriteError,
    LatestStore,
    MemoryLatestStore,
    StaleWriterError,
)
from elastic_runner.errors import ElasticRunError

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "ckpt_writer.py"
LOGGER = "elastic_runner.worker.checkpoint.checkpointer"


def payload(step: int) -> dict:
    return {
        "step": step,
        "model": {"w": torch.full((4, 3), float(step)), "b": torch.arange(3)},
        "optim": [{"lr": 0.1, "betas": (0.9, 0.99)}, None],
        "name": "run-a",
        "ok": True,
    }


def assert_payload(got: dict, step: int) -> None:
    want = payload(step)
    assert got["step"] == step and got["name"] == "run-a" and got["ok"] is True
    assert got["optim"] == want["optim"]
    assert torch.equal(got["model"]["w"], want["model"]["w"])
    assert torch.equal(got["model"]["b"], want["model"]["b"])


def step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def warnings_of(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


@pytest.fixture
def mem_url():
    url = f"memory://ckpt-test-{uuid.uuid4().hex}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


class Custom:
    def __init__(self) -> None:
        self.x = 1


def test_round_trip_plain_path(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=None)
    assert ckpt.load_latest() is None
    url = ckpt.save(7, payload(7))
    assert url.endswith("step-00000007")
    assert_payload(Checkpointer(tmp_path).load_latest(), 7)
    manifest = json.loads((tmp_path / "step-00000007" / "MANIFEST.json").read_text())
    assert manifest["step"] == 7 and manifest["format"] == 1
    assert manifest["bytes"] == (tmp_path / "step-00000007" / "state.pt").stat().st_size
    assert sorted(p.name for p in (tmp_path / "step-00000007").iterdir()) == [
        "MANIFEST.json", "state.pt",
    ]


def test_round_trip_memory_and_newest_chosen(mem_url):
    ckpt = Checkpointer(mem_url, keep=None)
    for step in (3, 1, 12, 5):
        ckpt.save(step, payload(step))
    reader = Checkpointer(mem_url, rank=1)
    assert_payload(reader.load_latest(), 12)
    assert reader.loaded_step == 12


def test_file_url_and_keep_two_leaves_two(tmp_path):
    ckpt = Checkpointer(f"file://{tmp_path}", keep=2)
    for step in range(1, 6):
        ckpt.save(step, payload(step))
    assert step_dirs(tmp_path) == ["step-00000004", "step-00000005"]
    assert_payload(ckpt.load_latest(), 5)


def test_keep_counts_verified_steps_only(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2)
    ckpt.save(1, payload(1))
    ckpt.save(2, payload(2))
    (tmp_path / "step-00000001" / "MANIFEST.json").unlink()  # now uncommitted
    ckpt.save(3, payload(3))
    # Step 1 no longer counts (and, being unverified below the new save, is gone).
    assert step_dirs(tmp_path) == ["step-00000002", "step-00000003"]


def test_flipped_byte_falls_back_with_one_warning(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, payload(1))
    ckpt.save(2, payload(2))
    state = tmp_path / "step-00000002" / "state.pt"
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    state.write_bytes(bytes(raw))
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert_payload(Checkpointer(tmp_path, rank=1).load_latest(), 1)
    (warning,) = warnings_of(caplog)
    assert "step-00000002" in warning.getMessage() and "sha256" in warning.getMessage()
    assert state.exists()  # left for inspection


def test_missing_manifest_is_skipped(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, payload(1))
    (tmp_path / "step-00000009").mkdir()
    (tmp_path / "step-00000009" / "state.pt").write_bytes(b"partial")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert_payload(ckpt.load_latest(), 1)
    (warning,) = warnings_of(caplog)
    assert "step-00000009" in warning.getMessage() and "MANIFEST" in warning.getMessage()


def test_sigkill_mid_write_keeps_previous(tmp_path, caplog):
    root, ready = tmp_path / "ckpt", tmp_path / "ready"
    Checkpointer(root).save(1, payload(1))
    proc = subprocess.Popen([sys.executable, str(HELPER), str(root), "2", str(ready)])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, "writer exited before reaching the pause"
            assert time.monotonic() < deadline, "writer never reached the pause"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(10)
    leftovers = [p.name for p in (root / "step-00000002").iterdir()]
    assert leftovers and all(".tmp-" in name for name in leftovers)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert_payload(Checkpointer(root, rank=1).load_latest(), 1)
    assert len(warnings_of(caplog)) == 1
    # The next save of the same step succeeds over the debris, and clears it.
    Checkpointer(root).save(2, payload(2))
    assert_payload(Checkpointer(root).load_latest(), 2)
    assert sorted(p.name for p in (root / "step-00000002").iterdir()) == [
        "MANIFEST.json", "state.pt"]


def test_stale_writer_is_refused(tmp_path):
    store = MemoryLatestStore({"url": "x", "step": 10, "sha256": "abc", "world_size": 4})
    assert isinstance(store, LatestStore)
    ckpt = Checkpointer(tmp_path, latest_store=store)
    with pytest.raises(StaleWriterError, match="step 5"):
        ckpt.save(5, payload(5))
    assert store.read() == {"url": "x", "step": 10, "sha256": "abc", "world_size": 4}
    assert not (tmp_path / "step-00000005").exists()  # known stale: writes nothing


class FencedStore(MemoryLatestStore):
    """Like etcd after our lease was revoked: reads fine, every publish fails."""

    def publish(self, record):
        return False


def test_fenced_writer_files_stay_record_unchanged(tmp_path):
    store = FencedStore()
    with pytest.raises(StaleWriterError, match="fenced"):
        Checkpointer(tmp_path, latest_store=store).save(5, payload(5))
    assert store.read() is None
    assert (tmp_path / "step-00000005" / "MANIFEST.json").exists()  # files stay


def test_store_record_wins_over_unpublished_files(tmp_path, caplog):
    store = MemoryLatestStore()
    ckpt = Checkpointer(tmp_path, keep=None, latest_store=store, world_size=2)
    ckpt.save(1, payload(1))
    ckpt.save(2, payload(2))
    record = store.read()
    assert record["step"] == 2 and record["world_size"] == 2
    assert record["url"].endswith("step-00000002")
    Checkpointer(tmp_path, keep=None).save(3, payload(3))  # not published
    assert_payload(Checkpointer(tmp_path, latest_store=store).load_latest(), 2)
    (tmp_path / "step-00000002" / "state.pt").write_bytes(b"garbage")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    reader = Checkpointer(tmp_path, latest_store=store)
    assert_payload(reader.load_latest(), 1)  # only steps below the record
    assert len(warnings_of(caplog)) == 1


def test_memory_store_cas_rules():
    store = MemoryLatestStore()
    rec = {"url": "u", "step": 4, "sha256": "a", "world_size": None}
    assert store.publish(rec) and store.publish(dict(rec))
    assert not store.publish({**rec, "sha256": "b"})
    assert not store.publish({**rec, "step": 3})
    assert store.publish({**rec, "step": 5, "sha256": "c"})
    assert store.read()["step"] == 5


def gated_write(monkeypatch) -> threading.Event:
    gate, original = threading.Event(), checkpoint_storage._write_all

    def write(fileobj, data):
        assert gate.wait(10), "test never opened the gate"
        original(fileobj, data)

    monkeypatch.setattr(checkpoint_storage, "_write_all", write)
    return gate


def test_async_save_returns_before_write_and_snapshots(tmp_path, monkeypatch):
    gate = gated_write(monkeypatch)
    ckpt = Checkpointer(tmp_path, async_save=True)
    state = payload(1)
    ckpt.save(1, state)
    assert not (tmp_path / "step-00000001" / "MANIFEST.json").exists()  # in flight
    state["model"]["w"].add_(100.0)
    state["name"] = "mutated"
    gate.set()
    ckpt.wait()
    assert (tmp_path / "step-00000001" / "MANIFEST.json").exists()
    assert_payload(Checkpointer(tmp_path, rank=1).load_latest(), 1)
    ckpt.close()


def test_async_error_is_reraised_on_wait(tmp_path, monkeypatch):
    def full(fileobj, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_storage, "_write_all", full)
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, payload(1))
    with pytest.raises(CheckpointWriteError):
        ckpt.wait()
    ckpt.wait()  # the error is reported once
    ckpt.close()


def test_non_zero_rank_writes_nothing(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", rank=3, async_save=True)
    assert ckpt.save(1, payload(1)) is None
    ckpt.wait()
    ckpt.close()
    assert not (tmp_path / "ckpt").exists()


def test_unwritable_root(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    Checkpointer(blocker / "ckpt", rank=1)  # non-zero ranks never write
    with pytest.raises(CheckpointError, match="cannot write") as info:
        Checkpointer(blocker / "ckpt", rank=0)
    assert isinstance(info.value, ElasticRunError)


def test_disk_full_keeps_previous_and_no_temp(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, payload(1))
    original = checkpoint_storage._write_all

    def full(fileobj, data):
        fileobj.write(memoryview(data)[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_storage, "_write_all", full)
    with pytest.raises(CheckpointWriteError, match="step-00000002") as info:
        ckpt.save(2, payload(2))
    assert "free space" in str(info.value)
    monkeypatch.setattr(checkpoint_storage, "_write_all", original)
    assert step_dirs(tmp_path) == ["step-00000001"]
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]
    assert_payload(ckpt.load_latest(), 1)


def test_disk_full_on_object_store_leaves_no_temp(mem_url, monkeypatch):
    ckpt = Checkpointer(mem_url)
    ckpt.save(1, payload(1))

    def full(fileobj, data):
        fileobj.write(memoryview(data)[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_storage, "_write_all", full)
    with pytest.raises(CheckpointWriteError):
        ckpt.save(2, payload(2))
    fs = fsspec.filesystem("memory")
    assert not [p for p in fs.find(mem_url) if ".tmp-" in p]
    assert_payload(Checkpointer(mem_url, rank=1).load_latest(), 1)


def test_weights_only_refuses_custom_class_loudly(tmp_path):
    Checkpointer(tmp_path).save(1, payload(1))
    Checkpointer(tmp_path).save(2, {"obj": Custom()})
    with pytest.raises(CheckpointError, match="weights_only=False"):
        Checkpointer(tmp_path, rank=1).load_latest()
    loaded = Checkpointer(tmp_path, rank=1, weights_only=False).load_latest()
    assert isinstance(loaded["obj"], Custom)


def test_due_and_request_save(tmp_path):
    ckpt = Checkpointer(tmp_path, every=5)
    assert [s for s in range(1, 12) if ckpt.due(s)] == [5, 10]
    never = Checkpointer(tmp_path, rank=1)
    assert not never.due(5)
    never.request_save()
    assert never.due(3) and never.due(4)  # stays due until a save happens
    never.save(4, payload(4))
    assert not never.due(5)


def test_resave_same_step_replaces_it(tmp_path):
    store = MemoryLatestStore()
    ckpt = Checkpointer(tmp_path, latest_store=store)
    ckpt.save(3, payload(3))
    ckpt.save(3, payload(3))  # a retried save: same bytes, same record
    with pytest.raises(StaleWriterError):
        ckpt.save(3, payload(4))  # other bytes for a published step: refused
    assert_payload(Checkpointer(tmp_path, latest_store=store).load_latest(), 3)
    plain = Checkpointer(tmp_path / "plain")
    plain.save(3, payload(3))
    plain.save(3, payload(4))
    assert_payload(plain.load_latest(), 4)


def test_invalid_arguments(tmp_path):
    with pytest.raises(ValueError):
        Checkpointer(tmp_path, keep=0)
    with pytest.raises(ValueError):
        Checkpointer(tmp_path).save(-1, {})


plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda kids: st.lists(kids, max_size=4)
    | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text(max_size=8), plain, max_size=5))
def test_plain_python_payload_round_trips_weights_only(state):
    url = f"memory://ckpt-prop-{uuid.uuid4().hex}"
    try:
        Checkpointer(url).save(0, state)
        assert Checkpointer(url, rank=1).load_latest() == state
    finally:
        fsspec.filesystem("memory").rm(url, recursive=True)


@pytest.mark.parametrize("location, phrase", [
    ("", "is empty"),                            # an unset variable: not the start folder
    ("   ", "is empty"),
    ("/shared/ckpt\nstep-9", "control character"),  # would forge lines in the logs
    ("file:///shared/a\tb", "control character"),
])
def test_a_location_that_is_empty_or_has_a_control_character_is_refused(location, phrase,
                                                                      tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=phrase):
        Checkpointer(location, every=5)
    assert list(tmp_path.iterdir()) == []  # nothing written where the worker started


def test_a_backend_that_cannot_connect_is_a_checkpoint_error():
    """fsspec's ftp connects when the filesystem is made; its socket error becomes ours."""
    with pytest.raises(CheckpointError, match="cannot open checkpoint location 'ftp://"):
        Checkpointer("ftp://127.0.0.1:1/run", every=5)


@pytest.mark.parametrize("options, message", [
    ({"keep": 1.5}, "keep must be a whole number >= 1 or None, got 1.5"),
    ({"keep": True}, "keep must be a whole number >= 1 or None, got True"),
    ({"every": "10"}, "every must be a whole number >= 1 or None, got '10'"),
    ({"keep": 0}, "keep must be a whole number >= 1"),
    ({"every": 2.0}, "every must be a whole number >= 1 or None, got 2.0"),
    ({"async_save": "False"}, "async_save must be True or False, got 'False'"),
    ({"weights_only": 0}, "weights_only must be True or False, got 0"),
])
def test_a_policy_value_of_the_wrong_type_is_refused_when_made(tmp_path, options, message):
    """Before: keep=1.5 tidied down to one step, every="10" failed with a TypeError in a
    comparison, async_save="False" (a string from a config file) saved asynchronously."""
    with pytest.raises(ValueError, match=re.escape(message)):
        Checkpointer(str(tmp_path / "ck"), **options)
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
