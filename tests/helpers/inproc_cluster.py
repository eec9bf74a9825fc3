"""The in-place worker tests' world: real `er.elastic` workers, one per "node"
folder with its own re-formation channel, and the test as every agent.

Used by tests/integration/test_inprocess_worker.py (its docstring says what the
scenarios show); here are the nodes, the cluster that holds and releases them, and
the checks every scenario makes.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_runner.contract import PLACEMENT_FIELDS, WorkerEnv, variable
from elastic_runner.etcd.server import free_port
from elastic_runner.reform import PAUSED, STANDBY_ROUND, Assignment, ReformChannel

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "inproc_worker.py"
SAMPLES, BATCH = 360, 12  # 30 steps; 12 splits evenly over 1, 2, 3 and 4 ranks
LAST_STEP = SAMPLES // BATCH
HOLD = 8
DEADLINE_S = 120.0
FORMATION_S = 3  # how long a re-forming worker waits for a new round's group


class Node:
    """One node's folder, channel and (at most one) worker process; the test is its agent."""

    def __init__(self, root: Path, name: str):
        self.dir = root / name
        self.dir.mkdir()
        self.channel = ReformChannel(self.dir / "reform")
        self.proc: subprocess.Popen | None = None

    def start(self, cluster: "Cluster", rank: int, world: int, port: int, round_number: int,
              *extra: str) -> None:
        self._spawn(cluster, WorkerEnv(
            rank=rank, local_rank=0, world_size=world, local_world_size=1, group_rank=rank,
            group_world_size=world, role_rank=rank, role_world_size=world,
            master_addr="127.0.0.1", master_port=port, round=round_number,
            notice_path=str(self.dir / "notice"), progress_dir=str(self.dir / "progress"),
            reform_dir=str(self.channel.directory), collective_timeout_s=30,
            formation_timeout_s=cluster.formation_s).to_env(), extra)

    def start_booted(self, cluster: "Cluster", rank: int, world: int, port: int,
                     round_number: int) -> None:
        """start(), returning once the worker has imported torch and goes to meet its
        round. Why: the others wait FORMATION_S for it, and on a loaded machine a
        Python start and `import torch` alone can take longer."""
        booted = self.dir / "booted"
        self.start(cluster, rank, world, port, round_number, "--booted", str(booted))
        cluster.wait(booted.exists, f"{self.dir.name}'s worker to import torch")

    def start_standby(self, cluster: "Cluster", *extra: str) -> None:
        """As agent/standby.py starts a joining node's worker: no place, no group."""
        env = WorkerEnv(local_rank=0, local_world_size=1, round=STANDBY_ROUND, standby=True,
                        notice_path=str(self.dir / "notice"),
                        progress_dir=str(self.dir / "progress"),
                        reform_dir=str(self.channel.directory), collective_timeout_s=30,
                        formation_timeout_s=cluster.formation_s).to_env()
        for name in PLACEMENT_FIELDS:
            env.pop(variable(name))
        self._spawn(cluster, env, extra)

    def _spawn(self, cluster: "Cluster", job_env: dict[str, str], extra: tuple[str, ...]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_RUN_", "TORCHELASTIC_"))}
        env.update(job_env)
        (self.dir / "progress").mkdir(exist_ok=True)
        self.log = open(self.dir / "worker.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--trace-dir", str(cluster.traces),
             "--samples", str(SAMPLES), "--batch", str(BATCH), "--release", str(cluster.go),
             *extra], env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def state(self):
        return self.channel.states().get(0)

    def output(self) -> str:
        return (self.dir / "worker.log").read_text(errors="replace")[-3000:]


class Cluster:
    def __init__(self, root: Path, count: int):
        self.root = root
        self.traces = root / "traces"
        self.traces.mkdir()
        self.go = root / "go"
        self.nodes = [Node(root, f"node{i}") for i in range(count)]
        self.formation_s = FORMATION_S  # for the workers started from now on

    def rows(self, kind: str) -> list[dict]:
        found = []
        for path in self.traces.glob("worker-*.jsonl"):
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line cut by a SIGKILL
                if row["kind"] == kind:
                    found.append(row)
        return found

    def wait(self, outcome, what: str, expect_exits: tuple[Node, ...] = ()):
        """Poll `outcome()` until truthy; fail at once if a worker not expected to
        exit has exited, and after DEADLINE_S with every worker's output."""
        deadline = time.monotonic() + DEADLINE_S
        while True:
            value = outcome()
            if value:
                return value
            for node in self.nodes:
                if node.proc is not None and node not in expect_exits \
                        and node.proc.poll() is not None:
                    pytest.fail(f"{node.dir.name} exited with {node.proc.returncode} while "
                                f"waiting for {what}:\n{node.output()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {DEADLINE_S:g} s:\n" + "\n".join(
                    f"--- {n.dir.name}: {n.state()}\n{n.output()}" for n in self.nodes))
            time.sleep(0.02)  # a polling interval, not a synchronisation

    def wait_held(self, nodes: list[Node]) -> None:
        pids = {node.proc.pid for node in nodes}
        self.wait(lambda: pids <= {row["pid"] for row in self.rows("held")}, "every worker held")

    def wait_phase(self, nodes: list[Node], round_number: int, phase: str,
                   expect_exits: tuple[Node, ...] = ()) -> list:
        def reached():
            states = [node.state() for node in nodes]
            if all(s is not None and s.round == round_number and s.phase == phase
                   for s in states):
                return states
            return None
        return self.wait(reached, f"{phase} in round {round_number}", expect_exits)

    def start_and_pause(self, nodes: list[Node], *extra: str) -> list:
        """Start `nodes` as round 0 (their order is their rank), hold them at step HOLD,
        ask each to pause and release them: their PAUSED reports."""
        port = free_port()
        for rank, node in enumerate(nodes):
            node.start(self, rank, len(nodes), port, 0, "--hold-at", str(HOLD), *extra)
        self.wait_held(nodes)
        for node in nodes:
            node.channel.ask_pause(0)
        self.go.touch()
        return self.wait_phase(nodes, 0, PAUSED)

    def exit_codes(self, nodes: list[Node]) -> list[int]:
        self.wait(lambda: all(n.proc.poll() is not None for n in nodes), "every worker's exit",
                  expect_exits=tuple(nodes))
        return [node.proc.returncode for node in nodes]

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                os.kill(node.proc.pid, signal.SIGKILL)
                node.proc.wait()



def assign(node: Node, round_number: int, rank: int, world: int, port: int) -> None:
    node.channel.assign(0, Assignment(round_number, rank, world, 1, rank, world,
                                      "127.0.0.1", port, restart_count=0))


def assign_in_order(nodes, round_number: int, world: int, port: int) -> None:
    """Give `nodes` ranks 0, 1, ... of `round_number` (a rank may stay empty: world)."""
    for rank, node in enumerate(nodes):
        assign(node, round_number, rank, world, port)


# ---- what every scenario checks ----------------------------------------------------
def completed_steps(cluster: Cluster) -> dict[int, list[dict]]:
    """Each step's rows from the last round that logged it."""
    by_step = collections.defaultdict(lambda: collections.defaultdict(list))
    for row in cluster.rows("step"):
        by_step[row["step"]][row["round"]].append(row)
    return {step: rounds[max(rounds)] for step, rounds in by_step.items()}


def assert_consistent(cluster: Cluster, worlds: dict[int, int]) -> None:
    """Every step 1..LAST_STEP was trained once, by every rank of its round's world
    (`worlds`: round -> world size), with equal parameters on every rank, and every
    sample of the epoch exactly once."""
    steps = completed_steps(cluster)
    assert sorted(steps) == list(range(1, LAST_STEP + 1))
    samples = collections.Counter()
    for step, rows in steps.items():
        round_number = rows[0]["round"]
        assert sorted(r["rank"] for r in rows) == list(range(worlds[round_number])), step
        assert {r["world"] for r in rows} == {worlds[round_number]}
        assert len({r["hash"] for r in rows}) == 1, f"ranks disagree on step {step}: {rows}"
        for row in rows:
            samples.update(row["indices"])
    assert sorted(samples) == list(range(SAMPLES)) and set(samples.values()) == {1}


def pids_by_round(cluster: Cluster) -> dict[int, set[int]]:
    found = collections.defaultdict(set)
    for row in cluster.rows("step"):
        found[row["round"]].add(row["pid"])
    return found

