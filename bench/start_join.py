"""A node that joins while the job starts: elastic-run (restart path, in place, in place
with er.init(defer_group=True)) and torchrun, side by side.

Why: a large job's nodes never all arrive at once, and on a GPU cluster a worker's
start is long (CUDA, building the model, reading the checkpoint: tens of seconds to
minutes), so a straggler arrives while the others start. The workload
(bench/workload.py) sleeps --boot-delay seconds once its model is built, as that
start would take; --nodes nodes start together, one more --join-after seconds later.
Reported, from the workers' step logs: start -> the first step (at any size), start ->
the first step at which every rank of the full size trained, and how many worker
processes got past their start (er.init() or init_process_group; more than the ranks:
workers were restarted). Ratios are to torchrun.

    .venv/bin/python bench/start_join.py                  # 4 variants x 2 repeats, ~4 min
    .venv/bin/python bench/start_join.py --variants er-inproc,er-inproc+defer --repeats 1
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c  # noqa: E402
from rescale import VARIANTS  # noqa: E402

DEFAULT_VARIANTS = "er,er-inproc,er-inproc+defer,tr-noshare"
PEER = "tr-noshare"


def one_run(key: str, args, endpoint: str, workdir: Path) -> dict:
    """One job: --nodes nodes, one more after --join-after s; the figures of its start."""
    label, kind, env, extra = VARIANTS[key]
    total = args.nodes + 1
    job = c.Launcher(kind, workdir, min_nodes=1, max_nodes=total, nproc=args.nproc,
                     script_args=("--every", args.every, "--step-time", args.step_time,
                                  "--boot-delay", args.boot_delay, *extra),
                     env_extra=env, endpoint=endpoint, lease_ttl=args.lease_ttl,
                     settle=args.settle, run_id=f"startjoin-{key}-{int(time.time())}")
    try:
        t0 = job.start(*[f"n{i}" for i in range(args.nodes)])
        time.sleep(args.join_after)
        job.start("late")
        world = total * args.nproc
        row = c.wait_until(lambda: c.first_full_step(job.steps_file, world, t0),
                           args.timeout, poll=0.05)
        booted = [r for r in c.read_jsonl(job.steps_file) if r.get("kind") == "booted"]
        steps = c.steps_of(job.steps_file)
        return {"s": row["t"] - t0 if row else None,
                "first_step_s": steps[0]["t"] - t0 if steps else None,
                "error": None if row else f"no step at world size {world} within "
                                          f"{args.timeout:g} s",
                "workers_past_init": len({r["pid"] for r in booted}), "ranks": world}
    finally:
        job.stop_all()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=2, help="nodes that start together")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--boot-delay", type=float, default=10.0,
                    help="seconds a worker takes to build its model (the sleep)")
    ap.add_argument("--join-after", type=float, default=6.0,
                    help="seconds after the first nodes that the last one starts")
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--lease-ttl", type=int, default=5)
    ap.add_argument("--settle", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()
    keys = args.variants.split(",")
    unknown = [k for k in keys if k not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    from elastic_runner.etcd.server import EmbeddedEtcd

    info = c.env_info()
    base = Path(tempfile.mkdtemp(prefix="bench-startjoin-"))
    runs: dict[str, list[dict]] = {k: [] for k in keys}
    try:
        with EmbeddedEtcd() as etcd:
            for repeat in range(args.repeats):
                for key in keys:  # interleaved: the machine's drift spreads over all
                    print(f"repeat {repeat + 1}: {VARIANTS[key][0]} ...", flush=True)
                    result = one_run(key, args, etcd.endpoint, base / f"{key}-{repeat}")
                    print(f"  {result}", flush=True)
                    runs[key].append(result)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("\n" + report(args, info, keys, runs))


def report(args, info: dict, keys: list[str], runs: dict[str, list[dict]]) -> str:
    summary = {k: {"s": c.mmm([r["s"] for r in runs[k]]),
                   "first_step_s": c.mmm([r["first_step_s"] for r in runs[k]]),
                   "workers_past_init": c.mmm([r["workers_past_init"] for r in runs[k]])}
               for k in keys}
    rows = [["start -> first step (any size)"] + [c.fmt(summary[k]["first_step_s"])
                                                  for k in keys],
            ["start -> first step at full size"] + [c.fmt(summary[k]["s"]) for k in keys],
            ["worker processes past init (ranks: %d)" % ((args.nodes + 1) * args.nproc)]
            + [c.fmt(summary[k]["workers_past_init"], "", 0) for k in keys]]
    if PEER in keys:
        rows.append([f"time / {VARIANTS[PEER][0]}"] + [
            f"{c.ratio(summary[k]['s'], summary[PEER]['s']):.2f}"
            if c.ratio(summary[k]["s"], summary[PEER]["s"]) is not None else "n/a"
            for k in keys])
    head = (f"start_join: {args.nodes} x {args.nproc} worker(s) start, one more node "
            f"{args.join_after:g} s later; each worker builds its model for "
            f"{args.boot_delay:g} s; {args.repeats} repeat(s)\n{info['date_utc']} UTC, "
            f"{info['cores']} cores, torch {info['torch']}, etcd {info['etcd']}")
    text = head + "\n\n" + c.table(["figure"] + [VARIANTS[k][0] for k in keys], rows)
    path = c.save("start_join", {"args": {k: str(v) for k, v in vars(args).items()},
                                 "env": info, "runs": runs, "summary": summary}, text)
    return text + f"\n\nwrote {path} and {c.LATEST / 'start_join.json'}"


if __name__ == "__main__":
    main()
