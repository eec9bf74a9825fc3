"""Two simulated nodes on this machine survive a scale-up, a spot notice and a crash.

Starts an embedded etcd, runs examples/train_mlp.py under elastic-run as nodes
a and b, then: node c joins (2 -> 3), b gets a spot notice (SIGTERM, 3 -> 2),
c is SIGKILLed (2 -> 1). Prints each round with its world size and the pause
before it, from the workers' own step logs, and checks that every sample of the
epoch was trained on exactly once in the run's effective history.

    python examples/rescale_demo.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from elastic_runner.etcd.server import EmbeddedEtcd
from elastic_runner.events import read_jsonl

HERE = Path(__file__).resolve().parent
SAMPLES, BATCH = 9600, 32




def wait_for_world(path: Path, world: int, after_step: int, timeout: float = 90) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [r["step"] for r in read_jsonl(path) if r["world"] == world and r["step"] > after_step]
        if len(steps) >= 5 * world:
            return max(steps)
        time.sleep(0.2)
    raise SystemExit(f"demo: world size {world} not reached within {timeout:.0f} s")


def start(node: str, endpoint: str, workdir: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "elastic_runner", "--rdzv-endpoints", endpoint,
               "--run-id", "demo", "--node-id", node, "--min-nodes", "1", "--max-nodes", "3",
               "--lease-ttl", "3", "--settle", "1",
               str(HERE / "train_mlp.py"), "--samples", str(SAMPLES), "--global-batch", str(BATCH),
               "--every", "25", "--step-time", "0.03", "--checkpoint-dir", str(workdir / "ckpt"),
               "--trace", str(workdir / "trace.jsonl")]
    log = open(workdir / f"{node}.log", "wb")
    print(f"  start {node}")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def summarize(rows: list[dict], events: list[tuple[float, str]]) -> None:
    rounds: dict[int, list[dict]] = {}
    for row in rows:
        rounds.setdefault(row["round"], []).append(row)
    print(f"\n{'round':>5} {'world':>5} {'steps':>11} {'event before it':<34}")
    for number, group in sorted(rounds.items()):
        steps = [r["step"] for r in group]
        event = next((e for n, e in events if n == number), "start")
        print(f"{number:>5} {group[0]['world']:>5} {min(steps):>5}-{max(steps):<5} {event:<34}")
    last_round = {}  # a step re-done after a crash counts once: its latest round wins
    for row in rows:
        last_round[row["step"]] = max(last_round.get(row["step"], -1), row["round"])
    effective = [r for r in rows if r["round"] == last_round[r["step"]]]
    seen = Counter(i for row in effective for i in row["indices"])
    redone = len({r["step"] for r in rows if r["round"] != last_round[r["step"]]})
    exact = set(seen) == set(range(SAMPLES)) and set(seen.values()) == {1}
    print(f"\nsamples trained exactly once in the effective history: {exact} "
          f"({len(seen)}/{SAMPLES}); steps re-done after the crash: {redone}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="elastic-run-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "trace.jsonl"
    agents: dict[str, subprocess.Popen] = {}
    with EmbeddedEtcd() as etcd:
        print(f"embedded etcd at {etcd.endpoint}; logs in {workdir}")
        try:
            agents["a"] = start("a", etcd.endpoint, workdir)
            agents["b"] = start("b", etcd.endpoint, workdir)
            step = wait_for_world(path, 2, 0)
            agents["c"] = start("c", etcd.endpoint, workdir)
            step = wait_for_world(path, 3, step)
            print("  spot notice to b (SIGTERM)")
            agents["b"].send_signal(signal.SIGTERM)
            step = wait_for_world(path, 2, step)
            print("  crash of c (SIGKILL of the agent and its workers)")
            os.killpg(agents["c"].pid, signal.SIGKILL)
            wait_for_world(path, 1, step)
            code = agents["a"].wait(timeout=300)
        finally:
            for process in agents.values():
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
    events = [(1, "c joined (scale-up)"), (2, "spot notice to b"), (3, "c crashed (SIGKILL)")]
    summarize(read_jsonl(path), events)
    print(f"node a exited with {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
