"""Steady-state step time of the same workload under elastic-run vs torchrun.

One node x 2 workers (default) trains bench/workload.py for --steps steps with a
checkpoint every --every steps and no extra sleep, so a step is pure compute +
gloo all-reduce + the per-step log line. Step time = interval between rank 0's
consecutive step lines (the first --warmup steps skipped). The launchers run
alternately (A B A B ...) to spread the machine's background load over both.
Also reported: CPU seconds the launcher's own agent process used (sampled from
/proc while it ran; its workers excluded), and start -> first step.

    .venv/bin/python bench/overhead.py                 # ~1 min
    .venv/bin/python bench/overhead.py --steps 1000 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c  # noqa: E402


OMP_ROW = "elastic-run, OMP_NUM_THREADS=1 exported"


def cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def one(name: str, args, endpoint: str, workdir: Path) -> dict:
    kind = "torchrun" if name == "torchrun" else "elastic-run"
    env = {"OMP_NUM_THREADS": "1"} if "OMP" in name else {}
    job = c.Launcher(kind, workdir, env_extra=env, min_nodes=args.nodes, max_nodes=args.nodes, nproc=args.nproc,
                     endpoint=endpoint, script_args=("--steps", args.steps, "--every", args.every,
                                                     "--step-time", args.step_time))
    t0 = job.start(*[f"n{i}" for i in range(args.nodes)])
    cpu: dict[str, float] = {}
    deadline = time.time() + args.timeout
    while job.alive() and time.time() < deadline:
        for node, proc in job.agents.items():
            v = cpu_seconds(proc.pid)
            if v is not None:
                cpu[node] = v
        time.sleep(0.2)
    timed_out = bool(job.alive())
    job.stop_all()
    rows = [r for r in c.steps_of(job.steps_file) if r["rank"] == 0]
    times = [r["t"] for r in rows]
    gaps = [b - a for a, b in zip(times[args.warmup:], times[args.warmup + 1:])]
    return {"steps_logged": len(rows), "timed_out": timed_out,
            "start_to_first_step_s": times[0] - t0 if times else None,
            "step_ms_median": statistics.median(gaps) * 1000 if gaps else None,
            "step_ms_p90": pct(gaps, 0.9) * 1000 if gaps else None,
            "step_ms_mean": statistics.mean(gaps) * 1000 if gaps else None,
            "agent_cpu_s": sum(cpu.values()),
            "wall_s": times[-1] - times[0] if times else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--no-omp-row", action="store_true",
                    help="skip the extra elastic-run run with OMP_NUM_THREADS=1 exported")
    args = ap.parse_args()
    from elastic_runner.etcd.server import EmbeddedEtcd

    info = c.env_info()
    base = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    runs = {"elastic-run": [], "torchrun": []}
    if not args.no_omp_row:
        runs[OMP_ROW] = []
    with EmbeddedEtcd() as etcd:
        for rep in range(args.repeats):
            for kind in runs:
                r = one(kind, args, etcd.endpoint, base / f"{kind}-{rep}")
                print(f"  {kind} #{rep + 1}: {r}", flush=True)
                runs[kind].append(r)
    keys = ["step_ms_median", "step_ms_p90", "step_ms_mean", "start_to_first_step_s",
            "agent_cpu_s", "wall_s"]
    summary = {k: {m: c.mmm([r[m] for r in v]) for m in keys} for k, v in runs.items()}
    names = {"step_ms_median": "step time median (ms)", "step_ms_p90": "step time p90 (ms)",
             "step_ms_mean": "step time mean (ms)", "start_to_first_step_s": "start -> first step (s)",
             "agent_cpu_s": "agent process CPU (s)", "wall_s": "first -> last step (s)"}
    rows = []
    for m in keys:
        a, b = summary["elastic-run"][m], summary["torchrun"][m]
        r = c.ratio(a, b)
        row = [names[m], c.fmt(a, "", 2), c.fmt(b, "", 2), f"{r:.2f}" if r else "n/a"]
        if OMP_ROW in summary:
            o = summary[OMP_ROW][m]
            r2 = c.ratio(o, b)
            row += [c.fmt(o, "", 2), f"{r2:.2f}" if r2 else "n/a"]
        rows.append(row)
    text = (f"overhead: {args.nodes} node(s) x {args.nproc} workers, {args.steps} steps, checkpoint "
            f"every {args.every}, step sleep {args.step_time}s, {args.repeats} repeat(s) "
            f"alternating; median [min-max] over repeats\n"
            f"{info['date_utc']} UTC, {info['cores']} cores, torch {info['torch']}, etcd {info['etcd']}\n\n"
            + c.table(["figure", "elastic-run", "torchrun", "ratio er/tr"]
                      + (["elastic-run + OMP_NUM_THREADS=1", "ratio"] if OMP_ROW in summary else []),
                      rows)
            + "\ntorchrun exports OMP_NUM_THREADS=1 to its workers when --nproc-per-node > 1 "
              "(torch/distributed/run.py); elastic-run does the same (workers.worker_env)")
    print("\n" + text)
    path = c.save("overhead", {"args": vars(args), "env": info, "runs": runs, "summary": summary}, text)
    shutil.rmtree(base, ignore_errors=True)
    print(f"wrote {path} and {c.LATEST / 'overhead.json'}")


if __name__ == "__main__":
    main()
