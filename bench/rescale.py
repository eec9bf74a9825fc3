"""Resize latencies and lost work: elastic-run vs torchrun (c10d), side by side.

One job per launcher variant and repeat walks through the same events:

  start (N nodes)  ->  SIGKILL a non-host node  ->  a new node joins
  ->  SIGTERM a non-host node  ->  SIGKILL the host node
  ->  a non-host node freezes (SIGSTOP of its agent and workers: sockets open, no answer)

"host" is the node torchrun's c10d store lives on (the agent listening on the
rendezvous port) and, for elastic-run, the node of rank 0 (MASTER_ADDR's store).
Every figure is computed from the workers' own step logs (bench/workload.py):
the time from the event to the first step at which every rank of the new world
size has trained, and the steps trained before the event that had to be re-done.
Each event fires at the same point of the checkpoint interval (half-way), so lost
work is comparable. A job that dies is recorded as such and started afresh (from
its checkpoint) for the next event.

    .venv/bin/python bench/rescale.py              # N=3 x M=1, 2 repeats, ~10 min
    .venv/bin/python bench/rescale.py --nodes 2 --repeats 1 --variants er,tr
    .venv/bin/python bench/rescale.py --repeats 1 --variants er,tr-etcdv2   # needs pip install python-etcd
    .venv/bin/python bench/rescale.py --repeats 1 --variants er-inproc,tr-noshare --events freeze
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c  # noqa: E402

VARIANTS = {
    "er": ("elastic-run", "elastic-run", {}, ()),
    "er+ckpt": ("elastic-run + er.Checkpointer, due()-driven", "elastic-run", {},
                ("--ckpt", "er")),
    # Issue 13's script styles: the resize must not depend on how the loop is written.
    "er+cadence": ("elastic-run + ElasticSampler + Checkpointer on its own cadence",
                   "elastic-run", {}, ("--ckpt", "er-cadence")),
    "er+sampler": ("elastic-run + ElasticSampler, no checkpointer", "elastic-run", {},
                   ("--ckpt", "er-sampler")),
    # The restart path with interpreters that imported torch ahead of the round (--prewarm).
    "er+prewarm": ("elastic-run --prewarm", "elastic-run", {"ELASTIC_RUN_PREWARM": "1"}, ()),
    # Issue 15: the same workload written with er.State + @er.elastic.
    "er-inproc": ("elastic-run in-process (er.elastic)", "elastic-run", {},
                  ("--ckpt", "er-inproc")),
    "er-inproc+loader": ("elastic-run in-process, batches from er.ElasticDataLoader (2 "
                         "worker processes per rank)", "elastic-run", {},
                         ("--ckpt", "er-inproc", "--loader-workers", "2")),
    "er-inproc+defer": ("elastic-run in-process, er.init(defer_group=True)", "elastic-run", {},
                        ("--ckpt", "er-inproc", "--defer-group")),
    "er-inproc+prewarm": ("elastic-run in-process + --prewarm", "elastic-run",
                          {"ELASTIC_RUN_PREWARM": "1"}, ("--ckpt", "er-inproc")),
    # The restart path and torchrun with a torch DataLoader of 2 worker processes per rank.
    "er+loader": ("elastic-run, batches from a DataLoader (2 worker processes per rank)",
                  "elastic-run", {}, ("--loader-workers", "2")),
    "tr": ("torchrun c10d (default)", "torchrun", {}, ()),
    "tr+loader": ("torchrun c10d, batches from a DataLoader (2 worker processes per rank)",
                  "torchrun", {}, ("--loader-workers", "2")),
    "tr-noshare": ("torchrun c10d + TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "torchrun",
                   {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, ()),
    # torch's etcd backend: needs python-etcd and an etcd serving the v2 API
    # (3.5 with --enable-v2; 3.6 has none). The store is in etcd, so nothing to
    # kill for "host node" beyond rank 0's agent.
    "tr-etcdv2": ("torchrun etcd-v2 (etcd 3.5 --enable-v2)", "torchrun-etcd-v2", {}, ()),
}
EVENTS = ["start", "sigkill", "join", "sigterm", "host_sigkill", "freeze", "worker_sigkill"]
# each must leave a survivor
NEEDS_TWO = ("sigkill", "sigterm", "host_sigkill", "freeze", "worker_sigkill")
DESCR = {
    "start": "start -> first step at full size",
    "sigkill": "SIGKILL non-host node -> first step at smaller size",
    "join": "node joins -> first step at larger size",
    "sigterm": "SIGTERM non-host node -> first step at smaller size",
    "host_sigkill": "SIGKILL host node -> first step at smaller size",
    "freeze": "SIGSTOP non-host node (agent + workers) -> first step at smaller size",
    "worker_sigkill": "SIGKILL one worker of a non-host node alone (what it forked lives, "
                      "as after the OOM killer) -> first step of the next round, same size",
}


class JobDied(Exception):
    pass


def wait_world(job: c.Launcher, world: int, after: float, timeout: float,
               old: frozenset = frozenset()):
    """(row, None) when the world trains (a start of it not in `old`); (None,
    'died@Xs') when every agent exited; (None, 'timeout') otherwise."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        row = c.first_full_step(job.steps_file, world, after, old=old)
        if row:
            return row, None
        if not job.alive():
            return None, f"job died {time.time() - after:.1f}s after the event"
        time.sleep(0.1)
    return None, f"timeout {timeout:g}s"


def wait_mid_interval(job: c.Launcher, since: float, every: int, timeout: float = 60) -> float:
    """Wait until training has run at least one checkpoint interval since `since`
    and the newest step is half-way to the next checkpoint. Returns the step."""
    def ready():
        rows = [r for r in c.steps_of(job.steps_file) if r["t"] >= since]
        if not rows:
            return None
        first, last = rows[0]["step"], rows[-1]["step"]
        if last - first >= every and last % every == every // 2:
            return last
        return None
    return c.wait_until(ready, timeout, poll=0.02)


def last_step_before(job: c.Launcher, t: float, since: float = 0.0,
                     exclude_world: int | None = None,
                     old: frozenset | None = None) -> int | None:
    """The old world's last step: its world size differs from the new one's, or (a
    worker restarted at the same size) its start is one of `old`."""
    rows = [r["step"] for r in c.steps_of(job.steps_file)
            if since <= r["t"] < t and (c.incarnation(r) in old if old is not None
                                       else r["world"] != exclude_world)]
    return max(rows) if rows else None


def pause_and_transfer(job: c.Launcher, t_ev: float, row: dict | None, since: float,
                       target: int, old_starts: frozenset | None = None) -> dict:
    """How long training stood still (the old world's last step -> the new world's
    first, all ranks), how many worker processes the new world started (not seen
    stepping before the event), and what the state sync moved (er-inproc's sync rows:
    bytes received over all ranks, the slowest rank's seconds)."""
    if row is None:
        return {"pause_s": None, "new_procs": None, "sync_bytes": None, "sync_s": None}
    steps = c.steps_of(job.steps_file)
    old = [r["t"] for r in steps if since <= r["t"] < row["t"] and (
        c.incarnation(r) in old_starts if old_starts is not None else r["world"] != target)]
    before = {r["pid"] for r in steps if r["t"] < t_ev}
    first = c.first_full_step_rows(job.steps_file, target, t_ev, old=old_starts or frozenset())
    syncs = [r for r in c.read_jsonl(job.steps_file) if r.get("kind") == "sync"
             and t_ev <= r["t"] <= row["t"]]
    return {"pause_s": row["t"] - max(old) if old else None,
            "new_procs": len({r["pid"] for r in first} - before),
            "sync_bytes": sum(r["received"] for r in syncs) if syncs else None,
            "sync_s": max(r["seconds"] for r in syncs) if syncs else None}


def one_run(key: str, args, etcd_endpoint: str, workdir: Path) -> dict:
    label, kind, env, extra = VARIANTS[key]
    M, N = args.nproc, args.nodes
    script_args = ("--every", args.every, "--step-time", args.step_time, *extra)

    def new_job(tag: str) -> c.Launcher:
        return c.Launcher(kind, workdir, min_nodes=1, max_nodes=N, nproc=M,
                          script_args=script_args, env_extra=env, endpoint=etcd_endpoint,
                          lease_ttl=args.lease_ttl, settle=args.settle,
                          run_id=f"rescale-{key}-{os.getpid()}-{tag}-{int(time.time())}")

    res: dict = {}
    names = [f"n{i}" for i in range(N)]
    job = new_job("a")
    t0 = job.start(*names)
    row, err = wait_world(job, N * M, t0, args.event_timeout)
    res["start"] = {"s": row["t"] - t0 if row else None, "error": err, "redone": 0}
    joins = 0

    def restart_fresh(reason: str):
        nonlocal job
        job.stop_all()
        job = new_job(f"r{time.time():.0f}")
        t = job.start(*names)
        row, err2 = wait_world(job, N * M, t, args.event_timeout)
        if not row:
            raise JobDied(f"fresh start after '{reason}' failed: {err2}")
        return row["t"]

    phase_t = row["t"] if row else None
    if phase_t is None:
        job.stop_all()
        return res

    def fire(event: str):
        nonlocal phase_t, joins
        old_starts = None
        wait_mid_interval(job, phase_t, args.every)
        alive = job.alive()
        host = job.host_node()
        non_host = [n for n in reversed(alive) if n != host]
        if event == "join":
            joins += 1
            node = f"j{joins}"
            names.append(node)
            t_ev = job.start(node)
            target = N * M
        elif event == "worker_sigkill":
            old_starts = frozenset(map(c.incarnation, c.steps_of(job.steps_file)))
            t_ev = job.sigkill_worker(non_host[0])
            target = len(alive) * M
        elif event == "host_sigkill":
            if host is None:
                return {"s": None, "error": "host node not found", "redone": None}
            t_ev = job.sigkill(host)
            target = (len(alive) - 1) * M
            names.remove(host) if host in names else None
        else:
            victim = non_host[0]
            names.remove(victim) if victim in names else None
            signal_victim = {"sigkill": job.sigkill, "sigterm": job.sigterm,
                             "freeze": job.freeze}[event]
            t_ev = signal_victim(victim)
            target = (len(alive) - 1) * M
        row, err = wait_world(job, target, t_ev, args.event_timeout, old=old_starts or frozenset())
        # Re-done = steps the old world finished (before the new world's first step,
        # also after the event: a join is noticed late) that the new world trains again.
        before = last_step_before(job, row["t"], phase_t, exclude_world=target,
                                  old=old_starts) if row else None
        out = {"s": row["t"] - t_ev if row else None, "error": err,
               "redone": max(0, before - row["step"] + 1) if row and before is not None else None,
               "host": host, **pause_and_transfer(job, t_ev, row, phase_t, target, old_starts)}
        if event == "sigterm":
            victim_proc = job.agents[victim]
            try:
                victim_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            c.kill_tree(victim_proc.pid)
        if event == "freeze":
            job.sigkill(victim)  # the frozen machine is gone for good
        if event == "host_sigkill":
            out["survived"] = row is not None
        if row:
            phase_t = row["t"]
        return out

    for event in args.events:
        if event in NEEDS_TWO and len(job.alive()) < 2:
            # Losing a node must leave a survivor: bring the job back to N nodes first.
            try:
                names[:] = [f"n{i}" for i in range(N)]
                phase_t = restart_fresh("prepare host kill")
            except JobDied:
                break
        try:
            res[event] = fire(event)
        except Exception as exc:  # noqa: BLE001
            res[event] = {"s": None, "error": f"{type(exc).__name__}: {exc}", "redone": None}
        print(f"  [{label}] {event}: {res[event]}", flush=True)
        if res[event]["s"] is None and event != "host_sigkill":
            # The job is gone or stuck: restore N nodes for the next event.
            try:
                names[:] = [f"n{i}" for i in range(N)]
                phase_t = restart_fresh(event)
                res[event]["recovered_by_fresh_start"] = True
            except JobDied as exc:
                res[event]["error"] += f"; {exc}"
                break
    job.stop_all()
    return res


PAUSE_FIELDS = ("pause_s", "new_procs", "sync_bytes", "sync_s")


def pause_table(summary: dict, keys: list[str], events: list[str]) -> str:
    """Training stood still for (old world's last step -> new world's first), worker
    processes started, and the state moved to bring ranks level (in-process only)."""
    def cell(figures: dict) -> str:
        if not figures.get("pause_s"):
            return "n/a"
        text = (f"{c.fmt(figures['pause_s'], 's', 2)}, {c.fmt(figures['new_procs'], '', 0)} new "
                "proc(s)")
        if figures.get("sync_bytes") and figures["sync_bytes"]["median"]:
            text += (f", {figures['sync_bytes']['median'] / 1e3:.1f} kB in "
                     f"{c.fmt(figures['sync_s'], 's', 3)}")
        return text
    rows = [[DESCR[ev]] + [cell(summary[k][ev]) for k in keys] for ev in events]
    return ("training pause (last step of the old world -> first of the new, any rank), "
            "worker processes started, state received by ranks that were behind\n"
            + c.table(["event"] + [VARIANTS[k][0] for k in keys], rows))


def restart_floor(args, workdir: Path, world: int) -> dict:
    """A fresh python: import torch + gloo process group + model and optimizer (the
    first optimizer imports torch._dynamo) + checkpoint load + first step."""
    runs = []
    ckpt = workdir / "ckpt"
    for i in range(args.floor_repeats):
        out = workdir / f"floor-{i}.jsonl"
        port = c.free_port()
        t0 = time.time()
        procs = []
        for r in range(world):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(c.spawn([c.PY, str(c.WORKLOAD), "--out", str(out), "--ckpt-dir",
                                  str(ckpt), "--steps", "1000000", "--step-time", "0.05"],
                                 workdir / "floor.log", env))
        row = c.wait_until(lambda: c.first_full_step(out, world, t0), 60)
        starts = [r for r in c.read_jsonl(out) if r.get("kind") == "start"]
        for p in procs:
            c.kill_tree(p.pid)
            p.wait(timeout=10)
        if row and starts:
            s = max(starts, key=lambda r: r["t_pg"])
            built = s.get("model_s", 0.0)
            runs.append({"total": row["t"] - t0, "import_torch": s["t_torch"] - t0,
                         "process_group": s["t_pg"] - s["t_torch"],
                         "model_and_optimizer": built,
                         "ckpt_and_first_step": row["t"] - s["t_pg"] - built})
    return {k: c.mmm([r[k] for r in runs]) for k in ("total", "import_torch", "process_group",
                                                     "model_and_optimizer",
                                                     "ckpt_and_first_step")}


def etcd_v2_check() -> dict:
    from elastic_runner.etcd.server import EmbeddedEtcd
    info = {}
    # python-etcd ("etcd"), which torch's etcd/etcd-v2 backends import
    if importlib.util.find_spec("etcd") is not None:
        info["python_etcd"] = "installed"
    else:
        info["python_etcd"] = "not installed (torch's etcd-v2 backend imports it: skipped)"
    try:
        with EmbeddedEtcd(extra_args=("--enable-v2",)) as e:
            with urllib.request.urlopen(f"{e.endpoint}/v2/keys/", timeout=3) as r:
                info["etcd_v2_api"] = f"served by etcd 3.5 with --enable-v2 (HTTP {r.status})"
    except Exception as exc:  # noqa: BLE001
        info["etcd_v2_api"] = f"not available: {exc}"
    info["note"] = ("etcd 3.6 removed the v2 API; torch's etcd backends speak only v2 "
                    "(pytorch/pytorch#158326)")
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2, help="agents (N)")
    ap.add_argument("--nproc", type=int, default=1, help="workers per agent (M)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default="er,er+ckpt,tr,tr-noshare",
                    help=f"comma list of {','.join(VARIANTS)}")
    ap.add_argument("--every", type=int, default=20, help="checkpoint interval (steps)")
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--event-timeout", type=float, default=180)
    ap.add_argument("--lease-ttl", type=int, default=5, help="elastic-run --lease-ttl (its default)")
    ap.add_argument("--settle", type=float, default=2.0, help="elastic-run --settle (its default)")
    ap.add_argument("--floor-repeats", type=int, default=3)
    ap.add_argument("--events", default=",".join(EVENTS[1:]),
                    help=f"comma list of {','.join(EVENTS[1:])}, in the order given")
    args = ap.parse_args()
    args.events = args.events.split(",")
    unknown = sorted(set(args.events) - set(EVENTS[1:]))
    if unknown:
        ap.error(f"unknown event(s) {','.join(unknown)}: choose from {','.join(EVENTS[1:])}")
    from elastic_runner.etcd.server import EmbeddedEtcd

    keys = args.variants.split(",")
    info = c.env_info()
    base = Path(tempfile.mkdtemp(prefix="bench-rescale-", dir=c.RESULTS if c.RESULTS.exists() else None))
    started = time.time()
    results: dict = {k: [] for k in keys}
    v2_args = ("--enable-v2",) if "tr-etcdv2" in keys else ()
    with EmbeddedEtcd() as etcd, EmbeddedEtcd(extra_args=v2_args) as etcd_v2:
        for rep in range(args.repeats):
            for key in keys:
                wd = base / f"{key}-{rep}"
                print(f"repeat {rep + 1}/{args.repeats}: {VARIANTS[key][0]}", flush=True)
                endpoint = etcd_v2.endpoint if key == "tr-etcdv2" else etcd.endpoint
                results[key].append(one_run(key, args, endpoint, wd))
        floor = restart_floor(args, base / f"{keys[0]}-0", (args.nodes - 1) * args.nproc)
    v2 = etcd_v2_check()

    summary: dict = {}
    for key in keys:
        summary[key] = {}
        for ev in EVENTS:
            runs = [r.get(ev) for r in results[key] if r.get(ev)]
            summary[key][ev] = {"s": c.mmm([r["s"] for r in runs]),
                                "redone": c.mmm([r["redone"] for r in runs]),
                                "failures": [r["error"] for r in runs if r["error"]],
                                **{f: c.mmm([r.get(f) for r in runs if r.get(f) is not None])
                                   for f in PAUSE_FIELDS}}
            if ev == "host_sigkill":
                summary[key][ev]["survived"] = f"{sum(1 for r in runs if r.get('survived'))}/{len(runs)}"

    def cell(key, ev):
        s = summary[key][ev]
        txt = c.fmt(s["s"])
        if ev == "host_sigkill":
            txt = f"{'yes' if s['survived'].startswith(str(len(results[key]))) and s['s'] else 'no'} " \
                  f"({s['survived']}) {txt if s['s'] else ''}".strip()
        elif s["failures"]:
            txt += f" ({len(s['failures'])} failed)"
        if ev != "start":
            txt += f", redo {c.fmt(s['redone'], '', 0)}"
        return txt

    headers = ["event"] + [VARIANTS[k][0] for k in keys]
    trs = [k for k in keys if k.startswith("tr")]
    ers = [k for k in keys if k.startswith("er")]
    if ers and trs:
        headers += [f"{ers[0]}/{t}" for t in trs]
    rows = []
    for ev in ["start", *args.events]:
        row = [DESCR[ev]] + [cell(k, ev) for k in keys]
        if ers and trs:
            for t in trs:
                r = c.ratio(summary[ers[0]][ev]["s"], summary[t][ev]["s"])
                row.append(f"{r:.2f}" if r is not None else "n/a (torchrun: no step)")
        rows.append(row)
    # The floor bounds fresh restarts only (not in place, not in a --prewarm interpreter).
    restarting = [k for k in ers if "inproc" not in k and "prewarm" not in k]
    er_best = min((summary[k][ev]["s"]["median"] for k in restarting
                   for ev in ("sigkill", "sigterm") if summary[k][ev]["s"]), default=None)
    floor_med = floor["total"]["median"] if floor["total"] else None
    text = (f"rescale: N={args.nodes} agents x M={args.nproc} worker(s), checkpoint every "
            f"{args.every} steps, step sleep {args.step_time}s, {args.repeats} repeat(s); "
            f"median [min-max]; redo = steps re-done\n"
            f"{info['date_utc']} UTC, {info['cores']} cores, torch {info['torch']}, etcd {info['etcd']}\n\n"
            + c.table(headers, rows)
            + f"\n\nrestart floor (fresh python: import torch + gloo group of {(args.nodes - 1) * args.nproc}"
              f" + model and optimizer + ckpt load + first step): {c.fmt(floor['total'], 's', 2)}"
              f" (import torch {c.fmt(floor['import_torch'], 's', 2)}, process group "
              f"{c.fmt(floor['process_group'], 's', 2)}, model and optimizer "
              f"{c.fmt(floor['model_and_optimizer'], 's', 2)}, ckpt+first step "
              f"{c.fmt(floor['ckpt_and_first_step'], 's', 2)})"
            + (f"\nelastic-run's fastest shrink (median) is {er_best:.2f}s = floor + "
               f"{er_best - floor_med:.2f}s" if er_best and floor_med else "")
            + f"\netcd v2: {v2['etcd_v2_api']}; python-etcd: {v2['python_etcd']}"
            + f"\nwall time {time.time() - started:.0f}s")
    text += "\n\n" + pause_table(summary, keys, args.events)
    print("\n" + text)
    path = c.save("rescale", {"args": vars(args), "env": info, "summary": summary,
                              "runs": results, "restart_floor": floor, "etcd_v2": v2,
                              "variants": {k: VARIANTS[k][0] for k in keys}}, text)
    shutil.rmtree(base, ignore_errors=True)
    print(f"wrote {path} and {c.LATEST / 'rescale.json'}")


if __name__ == "__main__":
    main()
