"""Real agents on localhost: start, kill, and read what their workers logged.

A scenario reads like one: `job.start("a", "b", "c")`, `job.kill("a")`,
`job.fail_worker(rank=1, step=7)`, `job.wait_world(4)`. Waiting is on observed
outcomes (lines in the workers' step logs) with a generous deadline, never on
fixed sleeps.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from elastic_runner._process import signal_machine
from elastic_runner.events import read_jsonl  # the e2e tests import it from here
from tests.helpers.injected_fault import FAULT_DIR_VARIABLE, FIRED, armed_path

PROBE = Path(__file__).resolve().parents[1] / "helpers" / "probe_worker.py"
MLP = Path(__file__).resolve().parents[2] / "examples" / "train_mlp.py"


@dataclass
class Job:
    endpoint: str
    workdir: Path
    run_id: str = "e2e"
    min_nodes: int = 1
    max_nodes: int = 4
    nproc: int = 2
    lease_ttl: int = 2
    settle: float = 1.0
    script_args: tuple[str, ...] = ("--step-time", "0.05")
    extra_flags: tuple[str, ...] = ()
    script: Path = PROBE
    # The probe's all-reduce: "gloo", or "socket" (no torch; helpers/socket_world.py)
    # where a test checks the agents' decisions rather than torch.
    collective: str = "gloo"
    # Per-node command prefix (e.g. `ip netns exec NS`) and extra environment.
    wrap: dict[str, list[str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    agents: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def steps_file(self) -> Path:
        return self.workdir / "steps.jsonl"

    @property
    def fault_dir(self) -> Path:
        return self.workdir / "faults"

    @property
    def fast_file(self) -> Path:
        """A script given `--fast-file` this path stops sleeping per step once it exists."""
        return self.workdir / "fast"

    def hurry(self) -> None:
        """After a test's last change: the rest of the epoch runs without step sleeps
        (its idle tail was 10-25 s of a test's time, asserting nothing new)."""
        self.fast_file.touch()

    def command(self, node: str, **overrides) -> list[str]:
        flags = {"--rdzv-endpoints": self.endpoint, "--run-id": self.run_id, "--node-id": node,
                 "--min-nodes": self.min_nodes, "--max-nodes": self.max_nodes,
                 "--nproc-per-node": self.nproc, "--lease-ttl": self.lease_ttl,
                 "--settle": self.settle, "--stop-grace": 2,
                 **{"--" + name.replace("_", "-"): value for name, value in overrides.items()}}
        argv = [sys.executable, "-m", "elastic_runner"]
        for flag, value in flags.items():
            for item in value if isinstance(value, (list, tuple)) else [value]:
                argv += [flag, str(item)]
        output = ("--out", str(self.steps_file), "--collective", self.collective) \
            if self.script == PROBE else ()
        return [*argv, *self.extra_flags, str(self.script), *output, *self.script_args]

    def start(self, *nodes: str, **overrides) -> None:
        for node in nodes:
            log = open(self.workdir / f"agent-{node}.log", "ab")
            self.agents[node] = subprocess.Popen(
                [*self.wrap.get(node, []), *self.command(node, **overrides)], stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, FAULT_DIR_VARIABLE: str(self.fault_dir), **self.env})
            log.close()

    def agent_log(self, node: str) -> str:
        return (self.workdir / f"agent-{node}.log").read_text(errors="replace")

    def kill(self, node: str, signum: int = signal.SIGKILL) -> None:
        """Signal the node's agent and every process under it at once: SIGKILL plays a
        machine crash, SIGSTOP a machine freeze (workers included)."""
        signal_machine(self.agents[node].pid, signum)

    def terminate(self, node: str) -> None:
        self.agents[node].send_signal(signal.SIGTERM)

    def fail_worker(self, rank: int, step: int, exit_code: int = 3) -> None:
        """The worker of global rank `rank` exits with `exit_code` as it reaches `step`,
        once (the restarted round re-does the step without failing). Exact where a
        kill is timed: the training scripts ask at each step (helpers/injected_fault.py)."""
        if exit_code == 0:
            raise ValueError("a worker failure needs a non-zero exit code")
        self.fault_dir.mkdir(exist_ok=True)
        armed_path(self.fault_dir, rank, step).write_text(str(exit_code))

    def faults_fired(self) -> list[tuple[int, int]]:
        """(rank, step) of every fail_worker fault that went off."""
        names = [re.fullmatch(r"rank(\d+)-step(\d+)" + re.escape(FIRED), path.name)
                 for path in self.fault_dir.glob("*" + FIRED)]
        return sorted((int(m[1]), int(m[2])) for m in names if m)

    def steps(self) -> list[dict]:
        return read_jsonl(self.steps_file)

    def wait_for(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; agent logs:\n"
                             + "\n".join(f"--- {n}\n{self.agent_log(n)[-3000:]}"
                                         for n in self.agents))

    def wait_world(self, size: int, after: float = 0.0, timeout: float = 60.0,
                   min_steps: int = 3) -> list[dict]:
        """Wait until every rank of a world of `size` has logged `min_steps` steps."""
        def reached():
            rows = [r for r in self.steps() if int(r["WORLD_SIZE"]) == size and r["t"] >= after]
            by_round: dict[str, dict[int, int]] = {}
            for row in rows:
                counts = by_round.setdefault(row["ELASTIC_RUN_ROUND"], {})
                counts[int(row["RANK"])] = counts.get(int(row["RANK"]), 0) + 1
            for round_id, counts in by_round.items():
                if len(counts) == size and min(counts.values()) >= min_steps:
                    return [r for r in rows if r["ELASTIC_RUN_ROUND"] == round_id]
            return None
        return self.wait_for(reached, timeout, f"world size {size}")

    def wait_steps(self, more: int, timeout: float = 60.0) -> list[dict]:
        """Wait until every rank of the world has logged `more` steps from now on; return
        the rows logged meanwhile. The positive signal for a check that something (a
        re-formation) did not happen: training demonstrably went on in the meantime."""
        seen = len(self.steps())

        def reached():
            rows = self.steps()[seen:]
            counts = collections.Counter(r["RANK"] for r in rows)
            world = int(rows[-1]["WORLD_SIZE"]) if rows else 0
            return rows if rows and len(counts) == world and min(counts.values()) >= more \
                else None
        return self.wait_for(reached, timeout, f"{more} more steps on every rank")

    def wait_exit(self, node: str, timeout: float = 60.0) -> int:
        try:
            return self.agents[node].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {node} still running after {timeout:g} s:\n"
                                 + self.agent_log(node)[-3000:]) from None

    def _client(self):
        from elastic_runner.config import EtcdConfig
        from elastic_runner.etcd.client import EtcdClient

        return EtcdClient(EtcdConfig(tuple(self.endpoint.split(",")), timeout_s=2.0,
                                     retry_deadline_s=5.0))

    def node_keys(self) -> set[str]:
        """Node ids registered in etcd right now (their leases are alive)."""
        client = self._client()
        try:
            entries, _ = client.get_prefix(f"/elastic-runner/v2/{self.run_id}/nodes/")
        finally:
            client.close()
        return {kv.key.rsplit("/", 1)[-1] for kv in entries}

    def etcd_keys(self, under: str) -> list[str]:
        client = self._client()
        try:
            entries, _ = client.get_prefix(f"/elastic-runner/v2/{self.run_id}/{under}")
        finally:
            client.close()
        return [kv.key for kv in entries]

    def etcd_get(self, key: str) -> bytes | None:
        client = self._client()
        try:
            kv = client.get(f"/elastic-runner/v2/{self.run_id}/{key}")
        finally:
            client.close()
        return kv.value if kv else None

    def checkpoint_record(self) -> dict | None:
        """The run's record of its newest checkpoint in etcd (worker/checkpoint/etcd_store.py)."""
        from elastic_runner.rendezvous.protocol import checkpoint_key, run_prefix

        client = self._client()
        try:
            kv = client.get(checkpoint_key(run_prefix(self.run_id)))
        finally:
            client.close()
        return None if kv is None else json.loads(kv.value)

    def recorded_step(self) -> int:
        """The step of that record; -1 before the first."""
        return (self.checkpoint_record() or {}).get("step", -1)

    def stop_all(self) -> None:
        for process in self.agents.values():
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait(timeout=10)
