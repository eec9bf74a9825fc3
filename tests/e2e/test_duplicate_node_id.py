"""Issue 12, item 4, end to end: two real agents started with one --node-id.

Before the fix the second overwrote the first's node key and both trained as rank 0
of a world of one, at the same time.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.socket_probe]  # about the agents, not torch

STEPS = 150  # long enough that a still trains while the duplicate is refused


def test_a_second_agent_with_a_live_nodes_id_exits_2_and_the_first_trains_on(job):
    job.script_args = ("--step-time", "0.05", "--steps", str(STEPS),
                       "--fast-file", str(job.fast_file))
    job.start("a")
    job.wait_world(2)
    log_path = job.workdir / "agent-a-duplicate.log"
    with open(log_path, "wb") as log:
        duplicate = subprocess.Popen(job.command("a"), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        code = duplicate.wait(timeout=60)
    finally:
        if duplicate.poll() is None:
            os.killpg(duplicate.pid, signal.SIGKILL)
            duplicate.wait(timeout=10)
    output = log_path.read_text(errors="replace")
    assert code == 2, output
    assert job.agents["a"].poll() is None, "a ended before the duplicate was refused"
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, output
    assert errors[0].startswith("elastic-run: error: node id 'a' is already registered by "
                                f"a live agent of run '{job.run_id}'"), output
    assert "another --node-id" in errors[0]
    assert "Traceback" not in output
    job.hurry()
    assert job.wait_exit("a", timeout=120) == 0, job.agent_log("a")[-3000:]
    rows = job.steps()
    assert {r["WORLD_SIZE"] for r in rows} == {"2"}  # nobody else ever trained as 'a'
    last = [r for r in rows if r["step"] == STEPS - 1]
    assert sorted(int(r["RANK"]) for r in last) == [0, 1]
