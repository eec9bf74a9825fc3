"""Issue 12 end to end: the last async save is never lost on the way out, and a
published checkpoint that rots does not make the job unrecoverable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from elastic_runner.worker.checkpoint.checkpointer import Checkpointer
from elastic_runner.events import read_jsonl

pytestmark = pytest.mark.e2e

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "trust_worker.py"
LINE = "elastic-run worker: error:"


def on_disk(ckpt: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in ckpt.iterdir() if (p / "MANIFEST.json").exists())


def saved(events: Path) -> list[int]:
    return [e["step"] for e in read_jsonl(events) if e["kind"] == "checkpoint_saved"]


def run_alone(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """One worker outside elastic-run: world size 1, no process group."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ELASTIC_RUN_", "MASTER_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["ELASTIC_RUN_EVENTS_PATH"] = str(tmp_path / "events.jsonl")
    return subprocess.run([sys.executable, str(WORKER), "--ckpt", str(tmp_path / "ckpt"),
                           "--async-save", *args], capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.mark.parametrize("ending", ["with", "finish", "return"])
def test_a_lost_final_async_save_fails_the_worker_on_every_way_out(tmp_path, ending):
    done = run_alone(tmp_path, "--exit", ending, "--disk-full-from", "20")
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if LINE in line]
    assert len(errors) == 1, done.stderr
    assert "step 20" in errors[0] and "No space left on device" in errors[0]
    assert "Traceback" not in done.stderr
    assert on_disk(tmp_path / "ckpt") == [10]
    assert saved(tmp_path / "events.jsonl") == [10]


@pytest.mark.parametrize("ending", ["with", "return"])
def test_the_final_async_save_is_durable_before_exit_0(tmp_path, ending):
    done = run_alone(tmp_path, "--exit", ending)
    assert done.returncode == 0, done.stderr
    assert on_disk(tmp_path / "ckpt") == [10, 20]
    assert saved(tmp_path / "events.jsonl") == [10, 20]
    assert Checkpointer(tmp_path / "ckpt", rank=1).load_latest()["step"] == 20


def test_under_elastic_run_a_full_disk_at_the_last_step_is_a_failure(job, tmp_path):
    """The issue's report: before, "workers finished", exit 0, step 20 missing."""
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    job.script, job.nproc = WORKER, 2
    job.script_args = ("--ckpt", str(ckpt), "--async-save", "--exit", "return",
                       "--disk-full-from", "20")
    job.start("a", max_restarts=1, log_dir=logs)
    assert job.wait_exit("a", timeout=120) == 6
    log = job.agent_log("a")
    assert "step 20" in log and "No space left on device" in log
    assert "workers finished" not in log
    assert on_disk(ckpt) == [10]
    events = logs / "events.jsonl"
    assert 20 not in saved(events) and 10 in saved(events)


def test_a_rotten_newest_checkpoint_and_a_crash_redo_the_steps(job, tmp_path):
    ckpt, trace, pause = tmp_path / "ckpt", tmp_path / "trace.jsonl", tmp_path / "paused"
    logs = tmp_path / "logs"
    job.script, job.nproc = WORKER, 2
    job.script_args = ("--ckpt", str(ckpt), "--steps", "40", "--every", "10",
                       "--pause-at", "25", "--pause-file", str(pause), "--trace", str(trace),
                       "--step-time", "0.02")
    job.start("a", log_dir=logs)
    pid = int(job.wait_for(lambda: pause.exists() and pause.read_text(), 90, "the pause"))
    assert json.loads(job.etcd_get("checkpoint/latest"))["step"] == 20
    state = ckpt / "step-00000020" / "state.pt"
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0x01                        # the newest published checkpoint rots
    state.write_bytes(bytes(raw))
    os.kill(pid, signal.SIGKILL)                      # and a worker crashes

    assert job.wait_exit("a", timeout=120) == 0
    steps_by_run = defaultdict(set)
    for row in read_jsonl(trace):
        steps_by_run[row["first_run"]].add(row["step"])
    assert steps_by_run[True] >= set(range(1, 26))
    assert steps_by_run[False] == set(range(11, 41))  # resumed after step 10, redid 11..20
    # Only rank 0 (the writer) opened etcd: rank 1 read the record through its agent.
    assert not any(row["etcd_client"] for row in read_jsonl(trace) if row["rank"] == 1)
    assert any(row["etcd_client"] for row in read_jsonl(trace) if row["rank"] == 0)
    assert json.loads(job.etcd_get("checkpoint/latest"))["step"] == 40
    assert Checkpointer(ckpt, rank=1).load_latest()["step"] == 40
    events = read_jsonl(logs / "events.jsonl")
    loaded = [e["step"] for e in events if e["kind"] == "checkpoint_loaded"]
    assert loaded == [10]
    assert saved(logs / "events.jsonl").count(20) == 2
