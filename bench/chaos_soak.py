"""Chaos soak: random kills, spot notices and joins against a 3-5 agent job.

Runs examples/train_mlp.py (exactly-once sampler, er.Checkpointer) on an embedded
etcd for --duration seconds while a seeded random schedule SIGKILLs an agent
(crash), SIGTERMs one (spot notice) or starts one, keeping 3-5 agents alive. From
the workers' own index trace it reports, per completed epoch, samples lost and
samples trained twice in the run's effective history (a step re-done after a
crash replaces the lost copy), resizes survived, work re-done and goodput.

    python bench/chaos_soak.py --duration 600
Not part of CI. Prints a table and writes bench/results/chaos_soak-<time>.json and
bench/latest/chaos_soak.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from elastic_runner.etcd.server import EmbeddedEtcd
from elastic_runner.events import read_jsonl
from elastic_runner.events import EVENTS_FILE, read_events

ROOT = Path(__file__).resolve().parents[1]
SAMPLES, BATCH = 2048, 32




class Soak:
    def __init__(self, endpoint: str, workdir: Path, seed: int):
        self.endpoint, self.workdir = endpoint, workdir
        self.random = random.Random(seed)
        self.agents: dict[str, subprocess.Popen] = {}
        self.events: list[dict] = []
        self._next = 0

    def start(self) -> None:
        name = f"n{self._next}"
        self._next += 1
        command = [sys.executable, "-m", "elastic_runner", "--rdzv-endpoints", self.endpoint,
                   "--run-id", "soak", "--node-id", name, "--min-nodes", "1", "--max-nodes", "5",
                   "--lease-ttl", "3", "--settle", "1", "--log-dir", str(self.workdir / "logs"),
                   str(ROOT / "examples/train_mlp.py"),
                   "--samples", str(SAMPLES), "--global-batch", str(BATCH), "--epochs", "100000",
                   "--every", "20", "--step-time", "0.02",
                   "--checkpoint-dir", str(self.workdir / "ckpt"),
                   "--trace", str(self.workdir / "trace.jsonl")]
        log = open(self.workdir / f"{name}.log", "wb")
        self.agents[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        self.events.append({"t": time.time(), "event": "join", "node": name})

    def alive(self) -> list[str]:
        return [n for n, p in self.agents.items() if p.poll() is None]

    def strike(self) -> None:
        alive = self.alive()
        choices = (["join"] if len(alive) < 5 else []) + (["kill", "notice"] if len(alive) > 3
                                                           else [])
        action = self.random.choice(choices or ["join"])
        if action == "join":
            return self.start()
        victim = self.random.choice(alive)
        if action == "kill":
            os.killpg(self.agents[victim].pid, signal.SIGKILL)
        else:
            self.agents[victim].send_signal(signal.SIGTERM)
        self.events.append({"t": time.time(), "event": action, "node": victim})

    def stop(self) -> None:
        for process in self.agents.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)


def analyse(rows: list[dict], events: list[dict], agent_events: list[dict],
            duration: float) -> dict:
    last_round: dict[int, int] = {}
    for row in rows:
        last_round[row["step"]] = max(last_round.get(row["step"], -1), row["round"])
    effective = [r for r in rows if r["round"] == last_round[r["step"]]]
    epochs = sorted({r["epoch"] for r in effective})
    complete = epochs[:-1]  # the last one was cut by the end of the soak
    lost = duplicated = 0
    for epoch in complete:
        seen = Counter(i for r in effective if r["epoch"] == epoch for i in r["indices"])
        lost += SAMPLES - len(seen)
        duplicated += sum(count - 1 for count in seen.values())
    useful = sum(len(r["indices"]) for r in effective)
    total = sum(len(r["indices"]) for r in rows)
    resizes = {e["round"] for e in agent_events if e["kind"] == "resize"}
    trained_rounds = {r["round"] for r in rows}
    return {"duration_s": round(duration, 1), "events": Counter(e["event"] for e in events),
            "resizes_survived": len(resizes), "rounds_that_trained": len(trained_rounds),
            "completed_epochs": len(complete), "samples_lost": lost,
            "samples_duplicated": duplicated, "useful_samples": useful,
            "samples_redone": total - useful,
            "useful_samples_per_s": round(useful / duration, 1),
            "goodput_vs_work_done": round(useful / total, 4) if total else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--interval", type=float, default=15, help="mean seconds between faults")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="elastic-run-soak-"))
    with EmbeddedEtcd() as etcd:
        soak = Soak(etcd.endpoint, workdir, args.seed)
        started = time.time()
        try:
            for _ in range(3):
                soak.start()
            while time.time() - started < args.duration:
                time.sleep(soak.random.expovariate(1 / args.interval))
                if time.time() - started < args.duration:
                    soak.strike()
        finally:
            soak.stop()
    agent_events = read_events(workdir / "logs" / EVENTS_FILE)
    result = analyse(read_jsonl(workdir / "trace.jsonl"), soak.events, agent_events,
                     time.time() - started)
    result["events"] = dict(result["events"])
    result.update(date=time.strftime("%Y-%m-%d"), cores=os.cpu_count(), workdir=str(workdir))
    (workdir / "events.json").write_text(json.dumps(soak.events, indent=1))
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for folder, name in ((ROOT / "bench/results", f"chaos_soak-{stamp}.json"),
                         (ROOT / "bench/latest", "chaos_soak.json")):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["samples_lost"] == 0 and result["samples_duplicated"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
