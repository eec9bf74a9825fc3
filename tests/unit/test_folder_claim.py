"""Two runs saving into one checkpoint folder (folder_claim.py): the second writer is
refused with one line before it writes, tidying never deletes another run's newer
steps, and a run that resumed from an ended run's checkpoints takes them over."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from elastic_runner.errors import CheckpointError
from elastic_runner.worker.checkpoint.checkpointer import Checkpointer, MemoryLatestStore


def state(step: int) -> dict:
    return {"step": step, "w": torch.full((3,), float(step))}


def steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step-"))


def manifest(root: Path, step: int) -> dict:
    return json.loads((root / f"step-{step:08d}" / "MANIFEST.json").read_text())


def run(root: Path, run_id: str | None, keep: int | None = 3,
        origin: str | None = None) -> Checkpointer:
    return Checkpointer(root, keep=keep, latest_store=MemoryLatestStore(), run_id=run_id,
                        run_origin=origin)


def test_a_second_run_saving_into_the_folder_is_refused_and_writes_nothing(tmp_path):
    first = run(tmp_path, "run-a")
    first.save(10, state(10))
    first.save(20, state(20))
    before = {step: manifest(tmp_path, step) for step in (10, 20)}
    second = run(tmp_path, "run-b")
    with pytest.raises(CheckpointError) as refused:
        second.save(20, state(99))  # the step the first run recorded
    line = str(refused.value)
    assert "holds step 20 of run 'run-a', newer than any step this run ('run-b') loaded" \
        in line and "give each run its own checkpoint folder" in line and "\n" not in line
    assert {step: manifest(tmp_path, step) for step in (10, 20)} == before
    assert manifest(tmp_path, 20)["run_id"] == "run-a"
    assert torch.equal(run(tmp_path, "run-a").load_latest()["w"], state(20)["w"])


def test_a_run_that_resumed_is_refused_once_the_other_run_writes_past_that_step(tmp_path):
    first = run(tmp_path, "run-a")
    first.save(10, state(10))
    second = run(tmp_path, "run-b")
    assert second.load_latest()["step"] == 10
    second.save(15, state(15))  # above what it resumed from, nobody else there: fine
    with pytest.raises(CheckpointError, match=r"holds step 15 of run 'run-b', newer than any "
                                              r"step this run \('run-a'\) loaded"):
        first.save(20, state(20))  # the writer behind meets the other's newer step
    assert steps_on_disk(tmp_path) == [10, 15]
    second.save(25, state(25))  # the one ahead goes on


def test_a_run_continuing_an_ended_one_takes_its_checkpoints_over(tmp_path):
    ended = run(tmp_path, "run-a")
    for step in (10, 20, 30):
        ended.save(step, state(step))
    ended.close()
    new = run(tmp_path, "run-b", keep=2)
    assert new.load_latest()["step"] == 30
    for step in (40, 50):
        new.save(step, state(step))
    assert steps_on_disk(tmp_path) == [40, 50]  # the adopted history tidied as its own
    assert manifest(tmp_path, 50)["run_id"] == "run-b"


def test_tidying_never_deletes_another_runs_step_above_the_adopted_one(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    other = run(elsewhere, "run-a", keep=None)
    other.save(30, state(30))
    root = tmp_path / "ckpt"
    first = run(root, "run-a", keep=None)
    first.save(10, state(10))
    first.save(20, state(20))
    mine = run(root, "run-b", keep=1)
    assert mine.load_latest()["step"] == 20
    mine.save(40, state(40))
    shutil.copytree(elsewhere / "step-00000030", root / "step-00000030")  # a writer's late step
    (root / "step-00000030" / "state.pt").write_bytes(b"being rewritten")  # not even verified
    mine.save(50, state(50))
    assert steps_on_disk(root) == [30, 50]


def test_another_runs_step_is_never_overwritten_even_below_this_runs_newest(tmp_path):
    """The scan stops at this run's own newest step, but the step to be written is
    asked first: a restart that redoes steps below its own unpublished leftover (step
    50 here) must not clobber another run's checkpoint there."""
    elsewhere = tmp_path / "elsewhere"
    run(elsewhere / "a", "run-a", keep=None).save(40, state(40))
    run(elsewhere / "b", "run-b", keep=None).save(50, state(50))
    root = tmp_path / "ckpt"
    run(root, "run-a").save(20, state(20))
    mine = run(root, "run-b", keep=None)
    assert mine.load_latest()["step"] == 20
    mine.save(30, state(30))
    for step, source in ((50, "b"), (40, "a")):
        shutil.copytree(elsewhere / source / f"step-{step:08d}", root / f"step-{step:08d}")
    before = manifest(root, 40)
    with pytest.raises(CheckpointError, match="holds step 40 of run 'run-a'.*step 40 is not "
                                              "written"):
        mine.save(40, state(40))
    assert manifest(root, 40) == before


def test_folders_of_plain_scripts_and_older_manifests_name_no_run(tmp_path):
    """Outside elastic-run (no run id) nothing changes; a step without a run id in its
    manifest (an older release's) belongs to nobody and blocks no one."""
    plain = run(tmp_path, None)
    plain.save(10, state(10))
    assert "run_id" not in manifest(tmp_path, 10)
    run(tmp_path, "run-b").save(20, state(20))
    run(tmp_path, None).save(30, state(30))
    assert steps_on_disk(tmp_path) == [10, 20, 30]


def test_a_step_cut_short_is_no_evidence_of_another_writer(tmp_path):
    (tmp_path / "step-00000090").mkdir(parents=True)  # no manifest: never committed
    (tmp_path / "step-00000090" / "MANIFEST.json.tmp-x").write_text("{")
    run(tmp_path, "run-b").save(10, state(10))
    assert manifest(tmp_path, 10)["run_id"] == "run-b"


def test_a_corrupt_step_the_load_skipped_is_adopted_too(tmp_path):
    """A new run resuming after the newest checkpoint rotted: its load skipped that step
    and loaded an older one; saving over the rotten step must not look like a clash."""
    ended = run(tmp_path, "run-a")
    for step in (10, 20, 30):
        ended.save(step, state(step))
    rotten = tmp_path / "step-00000030" / "state.pt"
    raw = bytearray(rotten.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    rotten.write_bytes(bytes(raw))
    new = run(tmp_path, "run-b")
    assert new.load_latest()["step"] == 20
    new.save(30, state(30))
    assert manifest(tmp_path, 30)["run_id"] == "run-b"


def test_one_run_id_launched_on_two_etcds_is_refused_as_a_second_writer(tmp_path):
    """The same command started on two nodes that each run their own etcd: one run id,
    two origins (rendezvous/protocol.origin_key). Before, the same run id passed as
    the same writer, and the two launches overwrote each other's steps."""
    first = run(tmp_path, "train", origin="aaaa")
    first.save(10, state(10))
    first.save(20, state(20))
    before = manifest(tmp_path, 20)
    assert before["run_id"] == "train" and before["run_origin"] == "aaaa"
    second = run(tmp_path, "train", origin="bbbb")
    with pytest.raises(CheckpointError) as refused:
        second.save(20, state(99))
    line = str(refused.value)
    assert ("holds step 20 of run 'train' (origin aaaa), newer than any step this run "
            "('train' (origin bbbb)) loaded: one run id launched twice against two etcds"
            in line), line
    assert "start every node with the same --rdzv-endpoints" in line and "\n" not in line
    assert manifest(tmp_path, 20) == before
    resumed = run(tmp_path, "train", origin="bbbb")  # resuming takes the history over
    assert resumed.load_latest()["step"] == 20
    resumed.save(30, state(30))
    with pytest.raises(CheckpointError, match="holds step 30 of run 'train' \\(origin bbbb\\)"):
        first.save(30, state(30))  # the launch behind meets the other's newer step
    assert manifest(tmp_path, 30)["run_origin"] == "bbbb"


def test_tidying_keeps_another_launchs_newer_step(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    run(elsewhere, "train", keep=None, origin="aaaa").save(15, state(15))
    root = tmp_path / "ckpt"
    mine = run(root, "train", keep=1, origin="bbbb")
    mine.save(10, state(10))
    mine.save(20, state(20))
    shutil.copytree(elsewhere / "step-00000015", root / "step-00000015")  # a late writer's
    mine.save(30, state(30))
    assert steps_on_disk(root) == [15, 30]  # ours tidied to keep=1, the other's kept


def test_a_manifest_without_an_origin_matches_any_launch_of_its_run(tmp_path):
    """An older release's manifests (run id, no origin), and a launch whose agent gave
    no origin (an older agent in a mixed job): the run id alone decides, as before."""
    older = run(tmp_path, "train")
    older.save(10, state(10))
    assert "run_origin" not in manifest(tmp_path, 10)
    newer = run(tmp_path, "train", origin="aaaa")
    newer.save(20, state(20))  # its own run's unpublished step: no clash
    run(tmp_path, "train").save(30, state(30))
    assert steps_on_disk(tmp_path) == [10, 20, 30]
    run(tmp_path, "train", origin="aaaa").save(40, state(40))
