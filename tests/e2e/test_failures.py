"""Worker failures: counted once per round, job-wide, and fatal after --max-restarts.

On the torch-free probe (socket_world), whose victims die within milliseconds of the
crash, as fast as any: the job's error must still name the worker that crashed, not a
victim whose agent reported first (rendezvous/failures.lost_a_peer)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.socket_probe]  # about the agents, not torch


def test_crash_loop_ends_with_one_line_naming_the_worker(job, tmp_path):
    job.script_args = ("--step-time", "0.05", "--fail-at-step", "3", "--fail-rank", "3")
    job.start("a", "b", max_restarts=2, log_dir=tmp_path / "logs")
    codes = {node: job.wait_exit(node, timeout=90) for node in ("a", "b")}
    assert codes == {"a": 6, "b": 6}
    # Node ranks follow join order, so whichever node holds ranks 2..3 is the culprit.
    plan = next(l for l in job.agent_log("a").splitlines() if "round 2:" in l)
    culprit = next(n for n in ("a", "b") if f"{n}=ranks 2..3" in plan)
    for node in ("a", "b"):
        error = [l for l in job.agent_log(node).splitlines() if l.startswith("elastic-run: error:")]
        assert len(error) == 1, job.agent_log(node)
        assert f"worker global rank 3 (local rank 1) on node {culprit} exited with code 1" \
            in error[0]
        assert "--max-restarts 2" in error[0]
        assert "injected failure at step 3 on rank 3" in job.agent_log(node)
    # Three rounds ran (the first plus two restarts), each counted once, job-wide.
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in job.steps()} == {"0", "1", "2"}
    assert (tmp_path / "logs" / job.run_id / "round2" / "rank3.log").read_text().count(
        "injected failure") == 1


def test_one_failure_restarts_the_round_and_training_goes_on(job, tmp_path):
    marker = tmp_path / "failed-once"
    # Fails at step 2 only in the first round (the restart count is 0 there).
    job.script_args = ("--step-time", "0.05", "--fail-at-step", "2", "--fail-rank", "0",
                       "--steps", "8", "--fail-only-first")
    job.start("a", "b", max_restarts=1)
    assert job.wait_exit("a", timeout=90) == 0 and job.wait_exit("b", timeout=30) == 0
    rows = job.steps()
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in rows} == {"0", "1"}
    finished = [r for r in rows if r["TORCHELASTIC_RESTART_COUNT"] == "1" and r["step"] == 7]
    assert {int(r["RANK"]) for r in finished} == {0, 1, 2, 3}
    assert not marker.exists()
