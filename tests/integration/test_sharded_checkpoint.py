"""Sharded checkpoints with real ranks: FSDP2 on CPU/gloo saves at world 4 and
restores, resharded, at 2, 3 and 6; the etcd record fences a stale round; a corrupt
shard is skipped with one line. One forked job (tests/helpers/sharded_group.py) runs
every phase, and each test reads the outcome it is about."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from elastic_runner.etcd.server import EmbeddedEtcd, free_ports

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "sharded_group.py"
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root, out = tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("out")
    with EmbeddedEtcd() as etcd:
        done = subprocess.run(
            [sys.executable, str(HELPER), str(root), str(out), etcd.endpoint,
             *map(str, free_ports(4))], capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-4000:]
    phases = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(phases) == ["A", "B", "C", "D"], done.stderr[-4000:]
    return {"root": root, "log": done.stderr, **phases}


@pytest.mark.parametrize("phase,world", [("B", 2), ("C", 3), ("D", 6)])
def test_restore_at_another_world_equals_what_world_4_saved(job, phase, world):
    got = job[phase]
    assert job["A"]["restored"] is None  # the first start found nothing
    assert got["restored"] == 6
    assert got["diff"]["model"] <= TOLERANCE and got["diff"]["optim"] <= TOLERANCE
    assert got["diff_sampler"] == job["A"]["sampler-6"]  # position and policy travelled
    assert job["B"]["fresh"]["model"] > 1e-3  # a model that loaded nothing would fail


def test_samples_exactly_once_across_the_resize(job):
    """Steps 1-6 at world 4, then the rest of the epoch at world 2 from the checkpoint."""
    counts = Counter(job["A"]["consumed"] + job["B"]["consumed"])
    assert sorted(counts) == list(range(96)) and set(counts.values()) == {1}


def test_a_stale_round_is_refused_on_every_rank_and_never_recorded(job):
    assert job["A"]["stale_all"] == ["refused: StaleWriterError"] * 4
    assert job["A"]["record"]["step"] == 6 and job["A"]["record"]["format"] == "sharded"
    stale = job["root"] / "step-00000009"
    assert (stale / "MANIFEST.json").exists()  # written, but never the one resumed from
    assert job["B"]["restored"] == 6


def test_a_corrupt_shard_is_skipped_with_one_line_and_the_previous_one_loads(job):
    got = job["D"]
    assert got["after_corruption"] == 3
    assert got["diff_after_corruption"]["model"] <= TOLERANCE
    assert got["diff_after_corruption"]["optim"] <= TOLERANCE
    assert got["record"]["step"] == 3  # the rotten record was retracted
    lines = [line for line in job["log"].splitlines() if "skipping checkpoint" in line]
    assert len(lines) == 1, lines
    assert "step-00000006" in lines[0] and "__2_0.distcp" in lines[0]
