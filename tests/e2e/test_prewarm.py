"""--prewarm end to end: real agents on the restart path start their workers in
interpreters that imported torch ahead of time (agent/prewarm.py), the first round's
and a restart's alike, and leave none behind when they exit."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from elastic_runner.contract import PREWARM_MODULE
from tests.e2e.harness import Job, read_jsonl

INPROC = Path(__file__).resolve().parents[2] / "examples" / "train_inproc.py"

pytestmark = pytest.mark.e2e


def prewarm_processes(run_id: str) -> list[int]:
    """Live interpreters waiting for an order of this run (found by their environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if PREWARM_MODULE.encode() in command and \
                f"TORCHELASTIC_RUN_ID={run_id}".encode() in environ:
            found.append(int(entry.name))
    return found


def test_workers_of_the_first_round_and_of_a_restart_start_with_torch_imported(job):
    job.run_id = f"prewarm-{os.getpid()}"
    job.extra_flags = ("--prewarm",)
    job.script_args = ("--step-time", "0.05", "--steps", "240", "--fast-file", str(job.fast_file))
    job.start("a", "b")
    first = job.wait_world(4, min_steps=3)
    assert {r["preloaded"] for r in first} == {True}
    before = {r["pid"] for r in first}
    # The workers run in such interpreters too (/proc shows a process's first environment).
    job.wait_for(lambda: len(set(prewarm_processes(job.run_id)) - before) == 4, 60,
                 "the next interpreters waiting on both nodes")
    waiting = set(prewarm_processes(job.run_id)) - before
    job.terminate("b")                                  # a notice: a restarts at world 2
    after = job.wait_world(2, min_steps=3)
    assert {r["preloaded"] for r in after} == {True}
    assert {r["pid"] for r in after} <= waiting and not {r["pid"] for r in after} & before
    job.hurry()
    assert job.wait_exit("b", timeout=60) == 0
    assert job.wait_exit("a", timeout=120) == 0, job.agent_log("a")[-3000:]
    job.wait_for(lambda: not prewarm_processes(job.run_id), 30, "no interpreter left waiting")


def test_once_workers_re_form_in_place_no_interpreter_waits_for_them(etcd, tmp_path):
    """er.elastic workers survive resizes: a waiting interpreter would only serve a
    fallback, so the agent lets them go (the first round's ran the workers)."""
    trace = tmp_path / "trace.jsonl"
    job = Job(etcd.endpoint, tmp_path, script=INPROC, nproc=1, lease_ttl=3, settle=0.5,
              run_id=f"prewarm-inproc-{os.getpid()}", extra_flags=("--prewarm",))
    job.script_args = ("--samples", "2400", "--global-batch", "24", "--step-time", "0.05",
                       "--trace", str(trace), "--checkpoint-dir", str(tmp_path / "ckpt"),
                       "--fast-file", str(job.fast_file))
    try:
        job.start("a")
        job.wait_for(lambda: len(read_jsonl(trace)) >= 5, 90, "5 steps")
        time.sleep(5.0)  # past the refill delay (3 s) after the workers started
        workers = {row["pid"] for row in read_jsonl(trace)}
        assert set(prewarm_processes(job.run_id)) == workers  # the worker, nothing waiting
        job.hurry()
        assert job.wait_exit("a", timeout=120) == 0, job.agent_log("a")[-3000:]
    finally:
        job.stop_all()
