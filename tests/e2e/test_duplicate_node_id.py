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


GPUS = [f"GPU-{digit * 8}-0000-1111-2222-333344445555" for digit in "012"]


def fake_driver_tool(folder) -> str:
    """An `nvidia-smi` that lists three GPUs in the driver tool's format; the probe
    workers never touch CUDA, so only the agents' GPU claims see them."""
    folder.mkdir()
    lines = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: {uuid})\\n"
                    for i, uuid in enumerate(GPUS))
    tool = folder / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\nprintf '{lines}'\n")
    tool.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"


def test_a_second_agent_on_the_same_gpus_exits_2_and_the_job_never_sees_it(job):
    """The same command started twice on one GPU machine (default node ids differ:
    host and pid). Before, the second joined as a new node and put its workers on the
    first one's GPUs, which NCCL answers by failing the re-formed job."""
    job.env["PATH"] = fake_driver_tool(job.workdir / "driver")
    job.script_args = ("--step-time", "0.05", "--steps", "400",
                       "--fast-file", str(job.fast_file))
    job.start("a")  # 2 workers: GPUs 0 and 1
    job.wait_world(2)
    environment = {**os.environ, **job.env}
    log_path = job.workdir / "agent-b.log"
    with open(log_path, "wb") as log:
        second = subprocess.Popen(job.command("b"), stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True,
                                  env=environment)
    job.agents["b"] = second
    assert second.wait(timeout=60) == 2, log_path.read_text(errors="replace")
    output = log_path.read_text(errors="replace")
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in output, output
    assert errors[0].startswith(f"elastic-run: error: GPU {GPUS[0]} is already used by node "
                                f"'a' of run '{job.run_id}'"), output
    assert "CUDA_VISIBLE_DEVICES" in errors[0]
    assert job.agents["a"].poll() is None, "a ended while b was refused"
    # A third agent given a GPU of its own joins: the claim refuses clashes, not nodes.
    with open(job.workdir / "agent-c.log", "ab") as log:
        job.agents["c"] = subprocess.Popen(
            job.command("c", nproc_per_node=1), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
            env={**environment, "CUDA_VISIBLE_DEVICES": "2"})
    job.wait_world(3)
    job.hurry()
    assert job.wait_exit("a", timeout=120) == 0, job.agent_log("a")[-3000:]
    assert job.wait_exit("c", timeout=60) == 0, job.agent_log("c")[-3000:]
    rows = job.steps()
    assert {r["WORLD_SIZE"] for r in rows} == {"2", "3"}  # b's workers never trained
    assert sorted(int(r["RANK"]) for r in rows if r["step"] == 399) == [0, 1, 2]
