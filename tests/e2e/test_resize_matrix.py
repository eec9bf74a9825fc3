"""Resizes that do not depend on how the script is written (issue 13).

Four script styles (tests/helpers/style_worker.py) x three events (a node joins, a
SIGTERM spot notice, `elastic-run notice`). Each resize must end by the workers'
progress (the drain saw them stop at a step boundary), never by the deadline; a
script without a step boundary is stopped at once. Where a checkpointer exists no
step is lost; with a sampler every sample of the epoch is trained exactly once.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.harness import read_jsonl

pytestmark = pytest.mark.e2e

STYLE = Path(__file__).resolve().parents[1] / "helpers" / "style_worker.py"
SAMPLES, BATCH = 1120, 8  # 140 steps: the three resizes are over by step ~50 on a loaded
# machine; the steps after them run without their sleep (Job.hurry)


def wait_world(job, trace: Path, world: int, after: float, steps: int = 4) -> None:
    def seen():
        rows = [r for r in read_jsonl(trace) if r["world"] == world and r["t"] > after]
        return len(rows) >= steps * world
    job.wait_for(seen, 90, f"world {world}")


@pytest.mark.parametrize("style", ["due", "cadence", "sampler", "plain"])
def test_join_sigterm_and_cli_notice_resize_without_waiting_for_the_deadline(job, workdir, style):
    trace, logs = workdir / "trace.jsonl", workdir / "logs"
    job.script, job.nproc = STYLE, 1
    job.script_args = ("--style", style, "--trace", str(trace), "--checkpoint-dir",
                       str(workdir / "ckpt"), "--samples", str(SAMPLES),
                       "--global-batch", str(BATCH), "--fast-file", str(job.fast_file))
    job.start("a", "b", log_dir=logs)
    wait_world(job, trace, 2, 0)
    at = time.time()
    job.start("c", log_dir=logs)                       # a node joins: 2 -> 3
    wait_world(job, trace, 3, at)
    at = time.time()
    job.terminate("c")                                 # SIGTERM spot notice: 3 -> 2
    wait_world(job, trace, 2, at)
    at = time.time()
    sent = subprocess.run([sys.executable, "-m", "elastic_runner", "notice", "--rdzv-endpoints",
                           job.endpoint, "--run-id", job.run_id, "--node-id", "b"],
                          capture_output=True, text=True, timeout=60)
    assert sent.returncode == 0, sent.stderr
    wait_world(job, trace, 1, at)                      # elastic-run notice: 2 -> 1
    job.hurry()
    assert job.wait_exit("a", timeout=180) == 0, job.agent_log("a")[-3000:]
    for node in "bc":
        assert job.wait_exit(node, timeout=30) == 0, job.agent_log(node)[-3000:]

    drains = [e for e in read_jsonl(logs / "events.jsonl") if e["kind"] == "drain"]
    expected = "no-boundary" if style == "plain" else "progress"
    assert drains and {d["ended"] for d in drains} == {expected}, drains
    assert {d["reason"] for d in drains} == {"a node joins", "spot notice"}

    rows = read_jsonl(trace)
    rounds = Counter((r["step"], r["round"]) for r in rows if r["rank"] == 0)
    if style in ("due", "cadence"):
        steps = Counter(s for s, _ in rounds)
        redone = sorted(key for key in rounds if steps[key[0]] > 1)  # (step, round)
        checkpoints = [(e["kind"], e.get("step"), e.get("round"))
                       for e in read_jsonl(logs / "events.jsonl")
                       if e["kind"].startswith("checkpoint") or e["kind"] == "resize"]
        assert not redone and len(rounds) == SAMPLES // BATCH, (redone, checkpoints)
        seen = Counter(i for r in rows for i in r["indices"])
        assert set(seen) == set(range(SAMPLES)) and set(seen.values()) == {1}
    elif style == "sampler":  # no checkpoint: the last round trains the whole epoch once
        last = max(r["round"] for r in rows)
        seen = Counter(i for r in rows if r["round"] == last for i in r["indices"])
        assert set(seen) == set(range(SAMPLES)) and set(seen.values()) == {1}
    assert {r["world"] for r in rows} == {1, 2, 3}
