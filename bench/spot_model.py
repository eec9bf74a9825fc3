"""Whole spot traces at their real time scale through a discrete-event model of the launchers.

Why a model: spot_replay.py runs the real launchers, but compresses a 18 h trace x370 into
3 minutes (every fixed delay weighs 370 times more than on a cluster) and trains a toy MLP
whose restart costs 1.4 s; a 7B model's restart costs minutes. Here the whole trace keeps its
own clock, and each launcher answers each event with named costs: the ones rescale.py
measured on this machine (--profile measured) or those of a GPU-sized job (--profile gpu).

Rules (the same for every launcher; `simulate` applies them event by event):
 1. The trace's count is what is paid for; a drop is k nodes reclaimed at that instant (one
    event), a rise k nodes added (one event). The job runs at the trace's first count at t0.
 2. A reclaim comes with notice (SIGTERM first) unless it is one of the `unnoticed_fraction`
    picked deterministically (every 1/f-th drop); then it is a SIGKILL.
 3. A launcher answers an event with (lag, pause, lost): it trains on at the old size for
    `lag` (only joins have one), stops, re-does `lost` ("checkpoint": everything since the
    last periodic checkpoint; "step": the step in flight; "none"), and trains again at the
    available count `pause` seconds later.
 4. Periodic checkpoints every `checkpoint_interval_s` of training since the last resume from
    a checkpoint; saving them costs nothing here (the same script under every launcher).
 5. During a pause, a loss extends it to max(end, now + its pause) and takes in a waiting
    newcomer; a join is taken in while the round is still open (`round_s`: the pause before
    the workers restart), else it costs one more re-formation right after this one. A loss
    during a join's lag stops the job at once; a join then is taken in.
 6. torchrun loses its store host (rank 0's agent) with probability k / nodes per reclaim;
    the pause is the expected value of the two outcomes.
 7. A drop to zero ends the job (work since the checkpoint is lost unless the launcher saves
    on notice); a rise from zero starts it afresh from the checkpoint.
 8. goodput = useful node-seconds / node-seconds paid; useful samples = useful node-seconds x
    samples_per_node_s (perfect data-parallel scaling, for every launcher alike).

    .venv/bin/python bench/spot_model.py                      # both traces x both profiles
    .venv/bin/python bench/spot_model.py --profile gpu --trace bench/traces/<file> --no-save
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import fields, replace
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from spot_model_core import (  # noqa: E402
    Event, InProcessElastic, Job, Profile, REPLAY, RESCALE, RestartElastic, TRACES, Torchrun, Trace, events_of, load_trace, simulate, summary)

# ---- profiles --------------------------------------------------------------------
LABELS = {"tr": "torchrun c10d (default)", "tr-noshare": "torchrun c10d no-share",
          "er": "elastic-run restart", "er+ckpt": "elastic-run restart + er.Checkpointer",
          "er-inproc": "elastic-run in-process"}
README = "bench/README.md, 2026-12-02"
# Each launcher cost measured as the remainder of one rescale.py event: (event, parts taken
# off besides restart = restart floor + checkpoint load, bench/README.md's total for it).
# The README's total is used, and the parameter printed as assumed, only if rescale.json
# lacks that event. The measured profile has checkpoint_save_s = 0, so it is not taken off.
DERIVED = {
    "tr": {"keepalive_timeout_s": ("sigkill", ("last_call_s",), 43.1),
           "join_detect_s": ("tr-noshare.join", (), 3.5), "start_rendezvous_s": ("start", (), 3.5)},
    "tr-noshare": {"keepalive_timeout_s": ("sigkill", ("last_call_s",), 42.3),
                   "join_detect_s": ("join", (), 3.5), "start_rendezvous_s": ("start", (), 3.7)},
    "er": {"rendezvous_s": ("sigterm", (), 1.4), "kill_detect_s": ("sigkill", ("rendezvous_s",), 6.6),
           "join_rendezvous_s": ("join", (), 1.7), "start_rendezvous_s": ("start", (), 1.8)},
    "er+ckpt": {"rendezvous_s": ("sigterm", (), 2.0), "kill_detect_s": ("sigkill", ("rendezvous_s",), 6.0),
                "join_rendezvous_s": ("join", (), 2.6), "start_rendezvous_s": ("start", (), 4.1)}}
README_DIED = {("tr", "join"): 63.5, ("tr", "host_sigkill"): 1.0, ("tr-noshare", "host_sigkill"): 0.5}


def _add(*xs):
    """Sum with None propagating: a derived parameter is measured only if all parts are.
    A cost is never negative: a difference of two measured totals below 0 is noise."""
    return None if any(x is None for x in xs) else max(0.0, sum(xs))


class _Book:
    """Collects a profile's parameter values with their sources (a builder, not a result)."""

    def __init__(self, rescale: dict, replay: dict):
        self.docs = {"rescale.json": rescale, "spot_replay.json": replay}
        self.sources: dict = {}

    def read(self, file: str, path: str):
        node = self.docs.get(file) or {}
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node if isinstance(node, (int, float)) and not isinstance(node, bool) else None

    def take(self, key: str, value, where: str, fallback, why: str = README):
        ok = value is not None
        self.sources[key] = f"measured ({where})" if ok else f"assumed ({why}; {where}: absent)"
        return value if ok else fallback

    def note(self, key: str, value, source: str):
        self.sources[key] = source
        return value

    def total(self, v: str, ev: str):
        return self.read("rescale.json", f"summary.{v}.{ev}.s.median")

    def died(self, v: str, ev: str):
        """'job died 63.5s after the event' in rescale.json's failures -> 63.5."""
        node = self.docs["rescale.json"] or {}
        for part in ("summary", v, ev):
            node = node.get(part) if isinstance(node, dict) else None
        for text in (node or {}).get("failures") or []:
            m = re.search(r"job died ([0-9.]+)s", str(text))
            if m:
                return float(m.group(1))
        return None

    def derive(self, v: str, restart: float, vals: dict) -> dict:
        """DERIVED[v]'s costs, each the measured total minus the parts named before it."""
        for name, (event, minus, readme_total) in DERIVED[v].items():
            src, _, ev = event.rpartition(".")
            parts = restart + sum(vals[m] for m in minus)
            where = f"rescale.json:{src or v}.{ev} - " + " - ".join(minus + ("restart",))
            vals[name] = self.take(f"{v}.{name}", _add(self.total(src or v, ev), -parts), where,
                                   readme_total - parts)
        return vals


def _measured_job(b: _Book) -> Job:
    rd = b.read
    # A rescale.json from before model_and_optimizer was split out holds it inside
    # ckpt_and_first_step: either way the floor plus the load is the whole restart.
    built = rd("rescale.json", "restart_floor.model_and_optimizer.median") or 0.0
    floor = _add(rd("rescale.json", "restart_floor.import_torch.median"),
                 rd("rescale.json", "restart_floor.process_group.median"), built)
    step = b.take("job.step_s", rd("spot_replay.json", "results.er.median_step_s"),
                  "spot_replay.json:results.er.median_step_s", 0.088)
    every = rd("rescale.json", "args.every")
    load = rd("rescale.json", "restart_floor.ckpt_and_first_step.median")
    return Job(
        restart_floor_s=b.take("job.restart_floor_s", floor,
                               "rescale.json:restart_floor.import_torch+process_group"
                               "+model_and_optimizer", 0.73),
        checkpoint_load_s=b.take("job.checkpoint_load_s", load,
                                 "rescale.json:restart_floor.ckpt_and_first_step, incl. one step", 0.65),
        checkpoint_interval_s=b.take("job.checkpoint_interval_s", every * step if every else None,
                                     "rescale.json:args.every x job.step_s", 20 * step),
        checkpoint_save_s=b.note("job.checkpoint_save_s", 0.0,
                                 "config (0: er+ckpt's save is inside its measured rendezvous_s)"),
        step_s=step,
        state_bytes=b.note("job.state_bytes", 33284.0,
                           "config (workload.py: MLP 64-128-1 fp32, SGD: 8,321 params x 4 B)"),
        bandwidth_Bps=b.note("job.bandwidth_Bps", 1e9, "assumed (a loopback copy; negligible at 33 kB)"),
        samples_per_node_s=b.take("job.samples_per_node_s", rd("spot_replay.json", "results.er.per_node_samples_per_s"),
                                  "spot_replay.json:results.er.per_node_samples_per_s", 365.0),
        price_per_node_hour=b.note("job.price_per_node_hour", 0.158, "assumed (g4dn.xlarge spot, as spot_replay.py)"),
        unnoticed_fraction=b.note("job.unnoticed_fraction", 0.0, "assumed (AWS notices a spot reclaim 2 min ahead; "
                                  "the 'no notice' row uses 1.0)"))


def _torchrun(b: _Book, v: str, restart: float) -> Torchrun:
    vals = b.derive(v, restart, {"last_call_s": b.note(f"{v}.last_call_s", 30.0, "config (torch's default "
                                                       "last_call_timeout, as rescale.py runs it)")})
    died = b.died(v, "join")
    if b.total(v, "join") is None and died is None:       # rescale.json lacks the join
        died = b.note(f"{v}.dies_on_join", README_DIED.get((v, "join")), f"assumed ({README})")
    else:
        b.note(f"{v}.dies_on_join", died, f"measured (rescale.json:{v}.join: {'job died' if died else 'survived'})")
    b.note(f"{v}.join_death_s", died, b.sources[f"{v}.dies_on_join"] if died else "unused (survives joins)")
    if died:
        b.sources[f"{v}.join_detect_s"] += "; unused: dies on a join"
    host = b.take(f"{v}.host_death_s", b.died(v, "host_sigkill"), f"rescale.json:{v}.host_sigkill failure",
                  README_DIED[(v, "host_sigkill")])
    return Torchrun(v, LABELS[v], **vals, host_death_s=host, dies_on_join=died is not None, join_death_s=died or 0.0)


def _restart_elastic(b: _Book, v: str, saves: bool, restart: float) -> RestartElastic:
    how = "config (workload.py --ckpt er: er.Checkpointer)" if saves else "config (plain torch.save every K steps)"
    return RestartElastic(v, LABELS[v], **b.derive(v, restart, {}),
                          saves_on_notice=b.note(f"{v}.saves_on_notice", saves, how))


def _in_process(b: _Book, job: Job, er_start_s: float) -> InProcessElastic:
    """rescale.py's er-inproc row where it has one; issue 15's goals until then. Its join is
    timed from the newcomer's start, so the newcomer's boot and the transfer come off."""
    k, goal = "er-inproc", "issue 15 goal: {}"
    t = {ev: b.total(k, ev) for ev in ("start", "sigkill", "join", "sigterm")}
    transfer = job.state_bytes / job.bandwidth_Bps
    reform = b.take(f"{k}.reform_s", t["sigterm"], f"rescale.json:{k}.sigterm", 0.5, goal.format("SIGTERM <= 0.5 s"))
    return InProcessElastic(
        k, LABELS[k],
        detection_s=b.take(f"{k}.detection_s", _add(t["sigkill"], -reform), f"rescale.json:{k}.sigkill - reform_s",
                           1.0, goal.format("SIGKILL <= 1.5 s = detection + reform")),
        reform_s=reform,
        join_reform_s=_join_reform(b, k, t["join"], job, transfer, goal),
        start_rendezvous_s=b.take(f"{k}.start_rendezvous_s",
                                  _add(t["start"], -job.restart_floor_s, -job.checkpoint_load_s),
                                  f"rescale.json:{k}.start - restart", er_start_s, "as er.start_rendezvous_s"),
        survivors_hold_state=b.note(f"{k}.survivors_hold_state", True, "config (workload.py is data-parallel: "
                                    "every rank holds the whole model)"))


def _join_reform(b: _Book, k: str, total, job: Job, transfer: float, goal: str) -> float:
    """The others' pause on a join, less the state transfer (the model adds its own).
    rescale.py measures that pause directly now (the newcomer boots on standby while
    the others train); older rescale.json files only had the total from its start."""
    pause = _add(b.read("rescale.json", f"summary.{k}.join.pause_s.median"),
                 -(b.read("rescale.json", f"summary.{k}.join.sync_s.median") or 0.0))
    if pause is not None:
        return b.take(f"{k}.join_reform_s", pause, f"rescale.json:{k}.join.pause_s - sync_s", 1.0)
    return b.take(f"{k}.join_reform_s", _add(total, -job.restart_floor_s, -transfer),
                  f"rescale.json:{k}.join - restart_floor_s - transfer", 1.0,
                  goal.format("join <= 1 s + transfer"))


def measured_profile(rescale: dict, replay: dict) -> Profile:
    """This machine: rescale.py's per-event totals split into named parts, each part the
    measured total minus the parts named before it, so the model reproduces the totals."""
    b = _Book(rescale, replay)
    job = _measured_job(b)
    restart = job.restart_floor_s + job.checkpoint_load_s
    er = _restart_elastic(b, "er", False, restart)
    launchers = (_torchrun(b, "tr", restart), _torchrun(b, "tr-noshare", restart), er,
                 _restart_elastic(b, "er+ckpt", True, restart), _in_process(b, job, er.start_rendezvous_s))
    return Profile("measured", job, launchers, tuple(b.sources.items()))


GPU = {  # a GPU-sized job, each number assumed, with its reason (printed with the table)
    "restart_floor_s": (60.0, "import torch, CUDA context on 8 GPUs, NCCL init, build + shard a 7B model"),
    "checkpoint_load_s": (120.0, "112 GB of training state from shared storage at ~1 GB/s per node"),
    "checkpoint_interval_s": (1800.0, "every 30 min, a common setting for multi-day LLM training"),
    "checkpoint_save_s": (10.0, "blocking part of a save on notice: 14 GB per GPU to host memory, upload async"),
    "step_s": (5.0, "30 x 4096-token sequences per node per step at samples_per_node_s"),
    "state_bytes": (112e9, "7B params x 16 B: bf16 weights + fp32 master copy + Adam m and v"),
    "bandwidth_Bps": (25e9, "node-to-node state transfer over ~200 Gb/s links"),
    "samples_per_node_s": (6.0, "8 A100 x ~3k tokens/s (6 x 7e9 FLOP/token at ~40% of 312 TFLOP/s) / 4096"),
    "price_per_node_hour": (12.0, "an 8-GPU A100-class node on spot, ~$10-15/h; only the absolute $ use it"),
    "unnoticed_fraction": (0.0, "as measured: AWS notices every spot reclaim 2 min ahead")}
GPU_JOB = Job(**{k: v for k, (v, _) in GPU.items()})
GPU_INPROC = {"detection_s": (5.0, "NCCL reports no dead peer promptly: the agent's lease (TTL 5 s) does, then aborts"),
              "reform_s": (3.0, "a new NCCL communicator over the new world: seconds"),
              "join_reform_s": (3.0, "as reform_s; the transfer is state_bytes / bandwidth_Bps")}


def gpu_profile(measured: Profile) -> Profile:
    """A GPU-sized job: every job parameter assumed (GPU, with reasons); the launchers'
    own costs (timeouts, rounds) are the ones measured here, which do not grow with the model."""
    sources = {k: v for k, v in measured.sources if not k.startswith("job.")}
    sources.update({f"job.{k}": f"assumed ({why})" for k, (_, why) in GPU.items()})
    launchers = []
    for launcher in measured.launchers:
        if isinstance(launcher, InProcessElastic):
            launcher = replace(launcher, **{k: v for k, (v, _) in GPU_INPROC.items()})
            sources.update({f"{launcher.key}.{k}": f"assumed ({why})" for k, (_, why) in GPU_INPROC.items()})
            sources[f"{launcher.key}.survivors_hold_state"] = "assumed (HSDP: sharded in a node, replicated " \
                                                               "across nodes)"
        launchers.append(launcher)
    return Profile("gpu", GPU_JOB, tuple(launchers), tuple(sources.items()))


# ---- output ----------------------------------------------------------------------
CHECKS = (("start", Event(0, "join", 0, 2), 0.0), ("sigkill", Event(0, "kill", 2, 1), 0.0),
          ("join", Event(0, "join", 1, 2), 0.0), ("sigterm", Event(0, "notice", 2, 1), 0.0),
          ("host_sigkill", Event(0, "kill", 2, 1), 1.0))
ROWS = (("re-formations (job stopped)", "stops", "{:.0f}"), ("paused, wall (h)", "paused_h", "{:.2f}"),
        ("work re-done (node-h)", "lost_node_h", "{:.2f}"),
        ("idle while paused (node-h)", "idle_node_h", "{:.2f}"),
        ("fewer nodes than available (node-h)", "under_node_h", "{:.2f}"),
        ("goodput", "goodput", "{:.3f}"), ("$ per 1M useful samples", "usd_per_1M_samples", "{:.3f}"))


def _fmt(v) -> str:
    return str(v) if isinstance(v, bool) or v is None else f"{v:.4g}"


def parameter_lines(p: Profile) -> list[str]:
    src = dict(p.sources)
    out = [f"parameters, profile {p.name} (measured: read from the file named; config: a setting of what was "
           "measured; assumed: not measured here, reason given):"]
    for obj, prefix in [(p.job, "job")] + [(x, x.key) for x in p.launchers]:
        for f in fields(obj):
            if f.name not in ("key", "label"):
                key = f"{prefix}.{f.name}"
                out.append(f"  {key:<34} {_fmt(getattr(obj, f.name)):>9}  {src.get(key, 'assumed')}")
    return out


def check_lines(p: Profile, rescale: dict) -> list[str]:
    """The measured parts added up again for rescale.py's own events (N=2 nodes), next to the
    measured totals: a part that does not add up shows here."""
    b = _Book(rescale, {})
    out = ["model vs rescale.json, N=2 (s; modelled lag + pause / measured median):"]
    for x in p.launchers:
        cells = []
        for name, ev, host in CHECKS if x.key in DERIVED or b.total(x.key, "sigkill") else ():
            r = x.respond(ev, p.job, 2, host)
            m, died = b.total(x.key, name), b.died(x.key, name)
            cells.append(f"{name} {r.lag_s + r.pause_s:.1f}/" + (_fmt(m) if died is None else f"died@{died:g}"))
        out += [f"  {x.key:<10} " + ", ".join(cells)] if cells else []
    return out


def run(trace: Trace, p: Profile) -> dict:
    """Every launcher of a profile through one trace, plus the same with no notice at all."""
    results = {x.key: summary(simulate(trace, x, p.job), p.job) for x in p.launchers}
    blind = replace(p.job, unnoticed_fraction=1.0)
    for x in p.launchers:
        results[x.key]["goodput_no_notice"] = simulate(trace, x, blind).goodput
    return results


def run_text(trace: Trace, p: Profile, results: dict, table) -> str:
    evs = events_of(trace, p.job.unnoticed_fraction)
    n = {k: sum(e.kind == k for e in evs) for k in ("notice", "kill", "join")}
    head = (f"{trace.name}, profile {p.name}: {(trace.end - trace.points[0][0]) / 3600:.1f} h at real time, "
            f"{len(evs)} events ({n['notice']} reclaims with notice, {n['kill']} without, {n['join']} joins), "
            f"up to {max(c for _, c in trace.points)} nodes, {results['tr']['paid_node_h']:.0f} node-h paid")
    keys = [x.key for x in p.launchers]
    rows = [[name] + [fmt.format(results[k][field]) for k in keys] for name, field, fmt in ROWS]
    for base in ("tr", "tr-noshare"):
        rows.append([f"cost per sample vs {LABELS[base]}"]
                    + [f"{results[base]['goodput'] / results[k]['goodput']:.2f}" for k in keys])
    rows.append(["goodput if no reclaim has notice"] + [f"{results[k]['goodput_no_notice']:.3f}" for k in keys])
    return head + "\n" + table(["figure"] + [LABELS[k] for k in keys], rows)


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        return doc
    except (OSError, ValueError) as exc:
        print(f"spot_model: {path}: {exc}; its parameters use bench/README.md's figures, printed as assumed",
              file=sys.stderr)
        return {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, action="append", help="repeatable; default: every trace in bench/traces")
    ap.add_argument("--profile", choices=("measured", "gpu", "all"), default="all")
    ap.add_argument("--rescale", type=Path, default=RESCALE)
    ap.add_argument("--replay", type=Path, default=REPLAY)
    ap.add_argument("--no-save", action="store_true", help="print only, write no JSON")
    args = ap.parse_args(argv)
    traces = []
    for path in args.trace or TRACES:
        try:
            traces.append(load_trace(path))
        except (OSError, ValueError) as exc:
            print(f"spot_model: trace {path}: {exc}", file=sys.stderr)
            return 2
    rescale = _read_json(args.rescale)
    measured = measured_profile(rescale, _read_json(args.replay))
    profiles = [p for p in (measured, gpu_profile(measured)) if args.profile in ("all", p.name)]
    import common as c   # here, not at the top: it installs signal handlers for launched processes
    blocks, runs = [], []
    for p in profiles:
        checks = check_lines(p, rescale) if p.name == "measured" and rescale.get("summary") else []
        blocks.append("\n".join(parameter_lines(p) + checks))
        for trace in traces:
            results = run(trace, p)
            runs.append({"trace": trace.name, "profile": p.name, "results": results})
            blocks.append(run_text(trace, p, results, c.table))
    text = (f"spot_model: whole traces at real time, discrete-event model (rules: bench/spot_model.py); "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC; rescale.json of "
            f"{rescale.get('env', {}).get('date_utc', 'n/a')} UTC\n\n" + "\n\n".join(blocks))
    print(text)
    if not args.no_save:
        params = {p.name: {k: {"value": _param(p, k), "source": s} for k, s in p.sources} for p in profiles}
        path = c.save("spot_model", {"parameters": params, "runs": runs}, text)
        # Relative to the repository: the printed text is pasted into bench/README.md.
        written = [Path(x).resolve().relative_to(c.ROOT) for x in (path, c.LATEST / "spot_model.json")]
        print(f"wrote {written[0]} and {written[1]}")
    return 0


def _param(p: Profile, key: str):
    prefix, name = key.split(".", 1)
    obj = p.job if prefix == "job" else next(x for x in p.launchers if x.key == prefix)
    return getattr(obj, name)


if __name__ == "__main__":
    sys.exit(main())
