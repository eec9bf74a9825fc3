"""Replay a spot-availability trace, time-compressed, under both launchers.

Each trace node is one agent x --nproc workers on this machine. The count is
scaled to at most --max-nodes agents (--map scale, default: round(count x max /
trace max), at least 1 while the trace is above 0), or capped (--map cap:
min(count, max)). Why scale by default: capped at 4, the g4dn trace (max 12) has
only 8 changes, all in its first 11%; scaled it keeps its churn. The trace's leading stretch at zero
nodes is skipped (nothing can run there); the rest is compressed by
factor = trace span / --duration. A drop in the count is a spot reclaim of a
randomly chosen node (same seed for every launcher): SIGTERM to its agent, then
SIGKILL of the whole node after the notice period (AWS gives 120 s; scaled, at
least --min-notice s). A rise starts new agents. An agent that exits on its own
(its job died) is replaced at once, as a cluster manager would.

Figures, all from the workers' step logs (bench/workload.py, constant per-rank
batch, so samples/step = batch x world):
  useful samples  samples of steps that stayed done (a step re-done after a resume
                  replaces its earlier copy; the earlier one counts as lost)
  goodput         useful samples / (node-seconds available x one node's samples/s
                  at full speed, measured in the same run: the median step time)
  boot ceiling    the goodput no launcher can pass here: each node trains from one
                  `import torch` (median, this run) after it appears, nothing else
                  costs. Compression shortens a node's life, never its boot: at x370 a
                  3 s boot stands for 18 trace minutes, so the ceiling falls with
                  --duration. "The script's boot": the same, with the median time a
                  worker also took to build its model and optimizer (the first
                  optimizer imports torch._dynamo: another ~1.5 s here)
  resizes         changes of world size seen by rank 0; (re)starts = worker processes
                  of rank 0 launched
  cost            per useful sample, relative to an always-full on-demand cluster:
                  (spot price / on-demand price) / goodput; and $ per 1M samples at
                  this toy workload's speed (only the ratio carries over to real GPUs)

    .venv/bin/python bench/spot_replay.py                    # ~5 min per launcher variant
    .venv/bin/python bench/spot_replay.py --duration 120 --variants er+ckpt,tr-noshare
    .venv/bin/python bench/spot_replay.py --trace bench/traces/aws-p3.2xlarge-16node-us-west-2a-2023-08-27.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c  # noqa: E402
from rescale import VARIANTS  # noqa: E402

DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "aws-g4dn-xlarge-us-east-1c-2020-11-20.csv"
ON_DEMAND = 0.526   # $/h, g4dn.xlarge us-east-1 Linux on-demand (AWS price list)
SPOT = 0.158        # $/h, ASSUMPTION: a typical g4dn.xlarge us-east-1 spot price (AWS spot
                    # price history, 2023-2024, ~70% below on-demand); not fetched here


def load_trace(path: Path) -> list[tuple[float, int]]:
    """Change points (trace second, count), sorted; same-second rows: the last wins."""
    if path.suffix == ".json":
        doc = json.loads(path.read_text())
        gap = doc.get("metadata", {}).get("gap_seconds", 300)
        points = [(i * gap, int(v)) for i, v in enumerate(doc["data"])]
    else:
        points = []
        for line in path.read_text().split():
            t, n = line.split(",")
            points.append((float(t), int(n)))
    out: list[tuple[float, int]] = []
    for t, n in sorted(points, key=lambda p: p[0]):
        if out and out[-1][0] == t:
            out[-1] = (t, n)
        elif not out or out[-1][1] != n:
            out.append((t, n))
    end = max(p[0] for p in points)
    return out, end


def value_at(points, t):
    v = points[0][1]
    for pt, n in points:
        if pt <= t:
            v = n
        else:
            break
    return v


def replay(key: str, schedule, duration: float, args, endpoint: str, wd: Path) -> dict:
    label, kind, env, extra = VARIANTS[key]
    job = c.Launcher(kind, wd, min_nodes=1, max_nodes=args.max_nodes, nproc=args.nproc,
                     script_args=("--every", args.every, "--step-time", args.step_time,
                                  "--local-batch", args.local_batch, *extra),
                     env_extra=env, endpoint=endpoint, lease_ttl=args.lease_ttl,
                     settle=args.settle, run_id=f"spot-{key}-{os.getpid()}-{int(time.time())}")
    rng = random.Random(args.seed)
    present: dict[str, float] = {}
    reclaiming: dict[str, float] = {}
    log: list[dict] = []
    counter = crashes = 0
    node_seconds = 0.0
    t0 = time.time()
    last = 0.0
    while True:
        now = time.time() - t0
        if now >= duration:
            break
        target = value_at(schedule, now)
        node_seconds += target * (now - last)
        last = now
        for n in list(present):
            if job.agents[n].poll() is not None:
                crashes += 1
                log.append({"t": now, "event": "agent-exited", "node": n,
                            "code": job.agents[n].returncode})
                del present[n]
        while len(present) > target:
            victim = sorted(present)[rng.randrange(len(present))]
            job.sigterm(victim)
            reclaiming[victim] = now + args.notice
            del present[victim]
            log.append({"t": now, "event": "reclaim", "node": victim})
        while len(present) < target:
            counter += 1
            name = f"n{counter:03d}"
            job.start(name)
            present[name] = now
            log.append({"t": now, "event": "add", "node": name, "pid": job.agents[name].pid})
        for n, at in list(reclaiming.items()):
            if now >= at:
                c.kill_tree(job.agents[n].pid)
                del reclaiming[n]
        time.sleep(0.1)
    job.stop_all()
    end = t0 + duration

    rows = [r for r in c.steps_of(job.steps_file) if r["rank"] == 0 and r["t"] <= end]
    done: dict[int, int] = {}
    lost = redone_steps = 0
    resizes, prev = 0, None
    gaps_by_pid: dict[int, list[float]] = {}
    last_t: dict[int, float] = {}
    for r in rows:
        if r["step"] in done:
            lost += done[r["step"]]
            redone_steps += 1
        done[r["step"]] = r["samples"]
        if prev is not None and r["world"] != prev:
            resizes += 1
        prev = r["world"]
        if r["pid"] in last_t:
            gaps_by_pid.setdefault(r["pid"], []).append(r["t"] - last_t[r["pid"]])
        last_t[r["pid"]] = r["t"]
    gaps = [g for v in gaps_by_pid.values() for g in v]
    step_s = statistics.median(gaps) if gaps else None
    useful = sum(done.values())
    per_node_rate = args.local_batch * args.nproc / step_s if step_s else None
    ideal = node_seconds * per_node_rate if per_node_rate else None
    goodput = useful / ideal if ideal else None
    boot = boot_figures(job, log, duration, t0, end)
    times = [t0] + [r["t"] for r in rows] + [end]
    gaps = [(a, b) for a, b in zip(times, times[1:]) if step_s and b - a > 1.0]
    stalled = sum(b - a for a, b in gaps)
    # For a post-mortem: each stretch without steps and the trace's events around it.
    stalls = [{"from_s": round(a - t0, 2), "to_s": round(b - t0, 2),
               "events": [f"{e['event']} {e['node']} @{e['t']:.1f}" for e in log
                          if a - t0 - 3.0 < e["t"] < b - t0]}
              for a, b in gaps]
    return {"label": label, "useful_samples": useful, "lost_samples": lost,
            "redone_steps": redone_steps, "unique_steps": len(done), "resizes": resizes,
            "worker_starts_rank0": len({r["pid"] for r in rows}), "agents_started": counter,
            "agent_exits_replaced": crashes, "node_seconds": node_seconds,
            "median_step_s": step_s, "per_node_samples_per_s": per_node_rate,
            "ideal_samples": ideal, "goodput": goodput, "stalled_s": stalled, **boot,
            "goodput_of_ceiling": goodput / boot["boot_ceiling"] if goodput else None,
            "goodput_of_script_ceiling": goodput / boot["boot_ceiling_script"]
            if goodput and boot["boot_ceiling_script"] else None,
            "cost_rel_on_demand": (SPOT / ON_DEMAND) / goodput if goodput else None,
            "spot_usd_per_1M_samples": SPOT / 3600 * node_seconds / useful * 1e6 if useful else None,
            "on_demand_usd_per_1M_samples": ON_DEMAND / 3600 / per_node_rate * 1e6 if per_node_rate else None,
            "t0_unix": t0, "stalls": stalls, "events": log}


def boot_figures(job, log: list[dict], duration: float, t0: float, end: float) -> dict:
    """What booting costs on this schedule, measured in this replay.

    boot_import_s: a worker's `import torch` (median over every worker process this
    replay started): any launcher pays at least this before a new node helps.
    boot_ceiling: the goodput a launcher would reach if a node trained from
    boot_import_s after it appeared and nothing else cost anything: the bound the
    compression puts on every launcher (a node's boot is not compressed, its
    lifetime is). boot_script_s / boot_ceiling_script: the same with the script's
    whole boot, `import torch` plus building its model and optimizer (the first
    optimizer imports torch._dynamo, as long again as torch here): also paid by any
    launcher on a fresh node. node_first_step_s: median time from a node's start to
    the first step one of its workers trained (nodes that trained at all)."""
    starts = [r for r in c.read_jsonl(job.steps_file)
              if r.get("kind") == "start" and "t_torch" in r and r["t_proc"] <= end]
    boot_s = statistics.median(r["t_torch"] - r["t_proc"] for r in starts) if starts else 0.0
    built = [r["t_torch"] - r["t_proc"] + r["model_s"] for r in starts if "model_s" in r]
    script_s = statistics.median(built) if built else None
    added: dict[str, float] = {}
    spans: list[float] = []
    for e in log:
        if e["event"] == "add":
            added[e["node"]] = e["t"]
        elif e["event"] in ("reclaim", "agent-exited") and e["node"] in added:
            spans.append(e["t"] - added.pop(e["node"]))
    spans += [duration - t for t in added.values()]
    whole = sum(spans)
    first_step: dict[int, float] = {}
    for r in c.steps_of(job.steps_file):
        first_step.setdefault(r["ppid"], r["t"])
    delays = [first_step[proc.pid] - job.started_at[node] for node, proc in job.agents.items()
              if proc.pid in first_step and first_step[proc.pid] <= end]

    def ceiling(boot: float | None) -> float | None:
        return sum(max(0.0, s - boot) for s in spans) / whole if whole and boot is not None else None
    return {"boot_import_s": boot_s, "boot_ceiling": ceiling(boot_s),
            "boot_script_s": script_s, "boot_ceiling_script": ceiling(script_s),
            "node_first_step_s": statistics.median(delays) if delays else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--duration", type=float, default=300, help="real seconds per replay")
    ap.add_argument("--max-nodes", type=int, default=4)
    ap.add_argument("--map", choices=("cap", "scale"), default="scale",
                    help="cap: min(count, max); scale: round(count x max / trace max)")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--local-batch", type=int, default=32)
    ap.add_argument("--notice", type=float, default=None, help="real s; default 120 s scaled")
    ap.add_argument("--min-notice", type=float, default=1.0)
    ap.add_argument("--variants", default="er,er+ckpt,tr,tr-noshare")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--lease-ttl", type=int, default=5)
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep the agents' logs and steps (the folder is printed) for a post-mortem")
    args = ap.parse_args()
    from elastic_runner.etcd.server import EmbeddedEtcd

    points, end = load_trace(args.trace)
    skip = next((t for t, n in points if n > 0), 0.0)
    top = max(n for _, n in points)
    span = end - skip
    factor = span / args.duration
    mapped = []
    for t, n in points:
        m = min(n, args.max_nodes) if args.map == "cap" else (max(1, round(n * args.max_nodes / top)) if n else 0)
        rt = max(0.0, (t - skip) / factor)
        if mapped and mapped[-1][0] == rt:
            mapped[-1] = (rt, m)
        elif not mapped or mapped[-1][1] != m:
            mapped.append((rt, m))
    if args.notice is None:
        args.notice = max(120 / factor, args.min_notice)
    info = c.env_info()
    changes = len(mapped) - 1
    print(f"trace {args.trace.name}: {span / 3600:.1f} h after skipping {skip / 3600:.1f} h at zero; "
          f"compressed x{factor:.0f} into {args.duration:g} s; {changes} count changes after "
          f"{args.map} at {args.max_nodes}; notice {args.notice:.2f} s real", flush=True)
    base = Path(tempfile.mkdtemp(prefix="bench-spot-"))
    results = {}
    with EmbeddedEtcd() as etcd:
        for key in args.variants.split(","):
            print(f"replaying under {VARIANTS[key][0]} ...", flush=True)
            results[key] = replay(key, mapped, args.duration, args, etcd.endpoint, base / key)
            r = results[key]
            print(f"  useful {r['useful_samples']} lost {r['lost_samples']} goodput "
                  f"{r['goodput'] if r['goodput'] is None else round(r['goodput'], 3)} resizes {r['resizes']} "
                  f"agent exits {r['agent_exits_replaced']}", flush=True)

    def f(v, d=2):
        return "n/a" if v is None else f"{v:.{d}f}"
    keys = list(results)
    rows = []
    for name, k, d in [("useful samples", "useful_samples", 0), ("samples lost (re-done)", "lost_samples", 0),
                       ("steps re-done", "redone_steps", 0), ("goodput", "goodput", 3),
                       ("boot ceiling (any launcher)", "boot_ceiling", 3),
                       ("goodput / boot ceiling", "goodput_of_ceiling", 3),
                       ("boot ceiling, the script's boot (any launcher)", "boot_ceiling_script", 3),
                       ("goodput / that ceiling", "goodput_of_script_ceiling", 3),
                       ("worker import torch, median (s)", "boot_import_s", 2),
                       ("+ model and optimizer built, median (s)", "boot_script_s", 2),
                       ("node start -> its first step, median (s)", "node_first_step_s", 1),
                       ("resizes (world changes)", "resizes", 0),
                       ("worker starts (rank 0)", "worker_starts_rank0", 0),
                       ("agents that died and were replaced", "agent_exits_replaced", 0),
                       ("time without steps > 1 s (s)", "stalled_s", 1),
                       ("cost per useful sample vs on-demand", "cost_rel_on_demand", 2),
                       ("spot $ per 1M samples (toy speed)", "spot_usd_per_1M_samples", 3)]:
        rows.append([name] + [f(results[x][k], d) for x in keys])
    tr = [x for x in keys if x.startswith("tr")]
    er = [x for x in keys if x.startswith("er")]
    ratio_lines = []
    for e in er:
        for t in tr:
            a, b = results[e]["goodput"], results[t]["goodput"]
            if a and b:
                ratio_lines.append(f"goodput {VARIANTS[e][0]} / {VARIANTS[t][0]} = {a / b:.2f}")
    od = results[keys[0]]["on_demand_usd_per_1M_samples"]
    text = (f"spot_replay: {args.trace.name}, {span / 3600:.1f} h (leading {skip / 3600:.1f} h at 0 "
            f"skipped) compressed x{factor:.0f} into {args.duration:g} s; counts {dict(cap='capped', scale='scaled')[args.map]} to "
            f"{args.max_nodes} agents x {args.nproc} worker(s) -> {changes} changes; notice "
            f"{args.notice:.2f} s real ({args.notice * factor:.0f} s trace); checkpoint every "
            f"{args.every} steps; seed {args.seed}\n"
            f"prices: on-demand ${ON_DEMAND}/h (g4dn.xlarge us-east-1), spot ${SPOT}/h (ASSUMED typical "
            f"us-east-1 spot price, AWS spot price history 2023-24, not fetched); always-full "
            f"on-demand = {f(od, 3)} $ per 1M samples at this speed\n"
            f"{info['date_utc']} UTC, {info['cores']} cores, torch {info['torch']}, etcd {info['etcd']}\n\n"
            + c.table(["figure"] + [VARIANTS[x][0] for x in keys], rows)
            + ("\n" + "\n".join(ratio_lines) if ratio_lines else ""))
    print("\n" + text)
    path = c.save("spot_replay", {"args": {k: str(v) for k, v in vars(args).items()}, "env": info,
                                  "factor": factor, "schedule_real_s": mapped,
                                  "skipped_leading_s": skip, "results": results}, text)
    if args.keep_logs:
        print(f"agents' logs kept in {base}")
    else:
        shutil.rmtree(base, ignore_errors=True)
    print(f"wrote {path} and {c.LATEST / 'spot_replay.json'}")


if __name__ == "__main__":
    main()
