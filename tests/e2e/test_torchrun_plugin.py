"""Unmodified torchrun on the etcd-v3 plugin: two agents form a world, one dies.

Why its own worker script: tests/helpers/probe_worker.py reads elastic-run's
ELASTIC_RUN_ROUND, which torchrun does not set, and the test needs each worker's
parent (agent) PID: torchrun starts workers in their own sessions, so killing an
agent's process group leaves its workers alive; a node's death means both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.harness import read_jsonl

from elastic_runner.config import EtcdConfig
from elastic_runner.rendezvous.protocol import SCHEMA_PREFIX
from elastic_runner.etcd.client import EtcdClient

pytestmark = pytest.mark.e2e

DEADLINE_S = 90

WORKER = '''
import datetime, json, os, sys, time
import torch, torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                  "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")}
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
with open(sys.argv[1], "a", buffering=1) as out:
    for step in range(steps):
        total = torch.ones(1)
        dist.all_reduce(total)
        out.write(json.dumps({"step": step, "t": time.time(), "pid": os.getpid(),
                              "ppid": os.getppid(), "reduced": int(total.item()), **env}) + "\\n")
        time.sleep(0.05)
dist.destroy_process_group()
'''


def torchrun(endpoint: str, script: Path, steps: Path, *script_args: str) -> list[str]:
    # --log-dir: without it torch leaves an empty torchelastic_* folder in /tmp per run.
    return [sys.executable, "-m", "torch.distributed.run",
            "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-id", "torchrun-e2e",
            "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3",
            "--monitor-interval", "0.2", "--rdzv-conf", "lease_ttl=2,settle=1",
            "--log-dir", str(steps.parent / "torchrun-logs"),
            str(script), str(steps), *script_args]


read_steps = read_jsonl


def wait_world(path: Path, size: int, after: float, logs: list[Path],
               min_steps: int = 3) -> list[dict]:
    """Wait until every rank of a world of `size` logged `min_steps` steps after `after`."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        rows = [r for r in read_steps(path) if int(r["WORLD_SIZE"]) == size and r["t"] > after]
        counts: dict[int, int] = {}
        for row in rows:
            counts[int(row["RANK"])] = counts.get(int(row["RANK"]), 0) + 1
        if len(counts) == size and min(counts.values()) >= min_steps:
            return rows
        time.sleep(0.1)
    tails = "\n".join(f"--- {log}\n{log.read_text(errors='replace')[-4000:]}" for log in logs)
    raise AssertionError(f"no world of size {size} within {DEADLINE_S} s; agent logs:\n{tails}")


def start_agents(endpoint: str, script: Path, steps: Path, logs: list[Path],
                 *script_args: str) -> list[subprocess.Popen]:
    agents = []
    for log in logs:
        with open(log, "wb") as out:
            agents.append(subprocess.Popen(
                torchrun(endpoint, script, steps, *script_args), stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
    return agents


def stop(agents: list[subprocess.Popen], steps: Path, script: Path) -> None:
    for agent in agents:
        kill_session(agent.pid)
        agent.wait(timeout=10)
    for pid in {r["pid"] for r in read_steps(steps)}:
        if runs(pid, script):
            kill_session(pid)  # workers live in their own sessions


def barrier_count(endpoint: str) -> bytes | None:
    """How many agents checked in at torch's exit barrier, read from etcd itself."""
    client = EtcdClient(EtcdConfig((endpoint,), timeout_s=2.0))
    try:
        kv = client.get(f"{SCHEMA_PREFIX}/torchrun-e2e/rounds/0/store/"
                        "torchelastic/agent/terminal_state/num_members")
    finally:
        client.close()
    return kv.value if kv else None


def runs(pid: int, script: Path) -> bool:
    """Still our worker? A logged PID may since have been reused."""
    try:
        return str(script).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.parametrize("workers_die", [True, False], ids=["node-dies", "agent-dies"])
def test_torchrun_survives_the_death_of_the_rank0_agent(etcd, tmp_path, workers_die):
    """node-dies: the survivor's worker fails on its collective; torchrun restarts it
    (one of --max-restarts) and re-rendezvouses. agent-dies: the orphaned worker keeps
    the collectives going, so only the lease expiry, seen by num_nodes_waiting in
    torchrun's monitor loop, triggers the re-formation; that costs no restart."""
    script, steps = tmp_path / "worker.py", tmp_path / "steps.jsonl"
    script.write_text(WORKER)
    endpoint = etcd.endpoint.removeprefix("http://")  # torchrun users write HOST:PORT
    logs = [tmp_path / f"agent-{i}.log" for i in range(2)]
    agents = start_agents(endpoint, script, steps, logs)
    try:
        rows = wait_world(steps, 2, after=0, logs=logs)
        assert {int(r["RANK"]) for r in rows} == {0, 1}
        assert {r["reduced"] for r in rows} == {2}  # each all-reduce saw both workers
        assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in rows}) == 1

        host = next(r for r in rows if r["RANK"] == "0")
        victim = next(a for a in agents if a.pid == host["ppid"])
        survivor = next(a for a in agents if a is not victim)
        killed_at = time.time()
        kill_session(victim.pid)  # the agent ...
        if workers_die:
            kill_session(host["pid"])  # ... and its worker, in its own session: the node is gone

        rows = wait_world(steps, 1, after=killed_at, logs=logs)
        assert {int(r["RANK"]) for r in rows} == {0}
        assert {r["ppid"] for r in rows} == {survivor.pid}
        assert {r["MASTER_PORT"] for r in rows} != {host["MASTER_PORT"]}
        print(f"SIGKILL ({'node' if workers_die else 'agent'}) -> first step at world 1: "
              f"{min(r['t'] for r in rows) - killed_at:.2f} s")
        assert survivor.poll() is None
        restarts = {r["TORCHELASTIC_RESTART_COUNT"] for r in rows}
        assert restarts == ({"1"} if workers_die else {"0"})
    finally:
        stop(agents, steps, script)


def test_torchrun_job_completes_through_the_exit_barrier(etcd, tmp_path):
    """Both agents return 0: torch's exit barrier (add + wait) ran on the etcd store."""
    script, steps = tmp_path / "worker.py", tmp_path / "steps.jsonl"
    script.write_text(WORKER)
    logs = [tmp_path / f"agent-{i}.log" for i in range(2)]
    agents = start_agents(etcd.endpoint, script, steps, logs, "20")
    try:
        codes = [agent.wait(timeout=DEADLINE_S) for agent in agents]
        tails = "\n".join(log.read_text(errors="replace")[-3000:] for log in logs)
        assert codes == [0, 0], tails
        rows = read_steps(steps)
        assert {(int(r["RANK"]), r["WORLD_SIZE"]) for r in rows} == {(0, "2"), (1, "2")}
        assert len(rows) == 40
        assert "Error waiting on exit barrier" not in tails  # torch only logs that
        assert barrier_count(etcd.endpoint) == b"2"
    finally:
        stop(agents, steps, script)
