"""A checkpoint the record store cannot take during an outage (etcd full or gone):
the files are kept, training goes on, nothing is tidied, the next save records, and
the last one fails loudly if it is still unrecorded at close (pending_record.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from elastic_runner.errors import CheckpointError, EtcdFull, EtcdUnavailable, StaleWriterError
from elastic_runner.worker.checkpoint.checkpointer import Checkpointer, MemoryLatestStore

LOGGER = "elastic_runner.worker.checkpoint"


class OutageStore(MemoryLatestStore):
    """Reads answer; while `out` is set every publish raises it, as etcd's client does."""

    def __init__(self) -> None:
        super().__init__()
        self.out: Exception | None = None

    def publish(self, record):
        if self.out is not None:
            raise self.out
        return super().publish(record)


def state(step: int) -> dict:
    return {"step": step, "w": torch.full((3,), float(step))}


def steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step-"))


def lines(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


FULL = EtcdFull("etcd at 127.0.0.1:1 is full and refused a transaction (NOSPACE)")


@pytest.mark.parametrize("outage", [FULL, EtcdUnavailable("no endpoint answered")],
                         ids=["full", "unreachable"])
def test_saves_in_an_outage_are_kept_unrecorded_untidied_and_the_next_one_records(
        tmp_path, caplog, outage):
    caplog.set_level(logging.INFO, logger=LOGGER)
    store = OutageStore()
    ckpt = Checkpointer(tmp_path, keep=1, latest_store=store)
    ckpt.save(10, state(10))
    store.out = outage
    assert ckpt.save(20, state(20)).endswith("step-00000020")  # no error: training goes on
    ckpt.save(30, state(30))
    assert store.read()["step"] == 10
    assert steps_on_disk(tmp_path) == [10, 20, 30]  # keep=1, yet the recorded step stays
    warned = lines(caplog, logging.WARNING)
    assert len(warned) == 1 and "step 20 is written and verified" in warned[0], warned
    assert str(outage) in warned[0]
    assert any("step 30 is written and verified" in line for line in lines(caplog, logging.INFO))
    # A restart meanwhile resumes from what the record names, never an unrecorded step.
    assert Checkpointer(tmp_path, rank=1, latest_store=store).load_latest()["step"] == 10
    store.out = None
    ckpt.save(40, state(40))
    assert store.read()["step"] == 40
    assert steps_on_disk(tmp_path) == [40]
    assert "checkpoint step 40 recorded" in lines(caplog, logging.WARNING)[-1]
    ckpt.close()  # nothing pending: no error


def test_the_last_save_still_unrecorded_at_close_is_one_clear_error(tmp_path):
    store = OutageStore()
    ckpt = Checkpointer(tmp_path, latest_store=store)
    ckpt.save(5, state(5))
    store.out = FULL
    ckpt.save(6, state(6))
    with pytest.raises(CheckpointError, match=r"last checkpoint, step 6 .* never recorded: "
                                              r"etcd at .* is full"):
        ckpt.close()
    assert store.read()["step"] == 5
    assert steps_on_disk(tmp_path) == [5, 6]  # nothing already saved is lost


def test_close_records_the_last_save_once_the_store_takes_writes_again(tmp_path, caplog):
    store = OutageStore()
    ckpt = Checkpointer(tmp_path, latest_store=store)
    store.out = FULL
    ckpt.save(7, state(7))
    assert store.read() is None
    store.out = None
    ckpt.close()
    assert store.read()["step"] == 7
    assert Checkpointer(tmp_path, rank=1, latest_store=store).load_latest()["step"] == 7


def test_a_pending_record_refused_at_close_is_a_stale_writer(tmp_path):
    """Meanwhile a newer step was recorded (or the round ended): refused, as the save
    itself would have been."""
    store = OutageStore()
    ckpt = Checkpointer(tmp_path, latest_store=store)
    store.out = FULL
    ckpt.save(7, state(7))
    store.out = None
    assert store.publish({"url": "elsewhere", "step": 9, "sha256": "s", "world_size": 1})
    with pytest.raises(StaleWriterError, match="step 7"):
        ckpt.close()
    assert store.read()["step"] == 9


def test_an_async_save_in_an_outage_raises_nothing_until_close(tmp_path):
    store = OutageStore()
    ckpt = Checkpointer(tmp_path, keep=1, async_save=True, latest_store=store)
    ckpt.save(1, state(1))
    ckpt.wait()
    store.out = FULL
    ckpt.save(2, state(2))
    ckpt.wait()  # the writer thread's publish met the outage: no error for the loop
    assert not ckpt.due(3)
    assert store.read()["step"] == 1 and steps_on_disk(tmp_path) == [1, 2]
    with pytest.raises(CheckpointError, match="step 2"):
        ckpt.close()
