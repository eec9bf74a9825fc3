"""One prepared check of in-process re-formation on a GPU machine (run by gpu_check.sh).

Why this shape: a GPU machine is lent for minutes, so one run must say everything.
It starts `elastic-run --standalone --nproc-per-node auto` (an embedded etcd, one
worker per visible GPU) on scripts/gpu_check_worker.py, whose ranks all fail a
collective at one step of the first round; the job must re-form in place (same
processes, a later round, a new NCCL communicator, each worker on the same GPU)
and train to the end. The workers' JSON lines are the evidence; `evaluate` turns
them into one PASS/FAIL line per check, and the timings follow. One more check starts
a `--prewarm` waiting interpreter: it must have imported torch._dynamo ahead without
making a CUDA context (which would hold GPU memory beside a training worker).

Exit codes: 0 every check passed; 1 a check failed; 2 nothing to check here (no GPU
visible, or a torch without CUDA or NCCL). `--cpu` runs the same flow on gloo with
the GPUs hidden: the dry run the tests use on a machine without one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

WORKER = Path(__file__).resolve().parent / "gpu_check_worker.py"
EXIT_PASSED, EXIT_FAILED, EXIT_CANNOT_RUN = 0, 1, 2


@dataclass(frozen=True)
class Expectation:
    """What a passing run looks like."""

    world: int  # workers in every round (one node: the local worker count)
    backend: str  # "nccl", or "gloo" for the --cpu dry run
    steps: int  # the last global step the workers train to
    budget_s: float  # elastic-run's whole run
    pause_bound_s: float  # injected failure -> first collective in the new group


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


class CannotRun(Exception):
    """This machine cannot run the check (no GPU, no NCCL): exit 2, one line."""


# ---- the workers' records -----------------------------------------------------------
def parse_records(lines: Iterable[str]) -> list[dict]:
    """The JSON objects of `lines`; a line cut short by a killed process is skipped."""
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "kind" in record and "pid" in record:
            records.append(record)
    return records


@dataclass
class Worker:
    """One process's records, in the order it wrote them."""

    pid: int
    init: dict | None = None
    formed: list[dict] = field(default_factory=list)  # one per call of the training function
    failed: dict | None = None
    steps: list[dict] = field(default_factory=list)
    done: dict | None = None


def by_worker(records: list[dict]) -> dict[int, Worker]:
    workers: dict[int, Worker] = {}
    for record in records:
        worker = workers.setdefault(record["pid"], Worker(record["pid"]))
        kind = record["kind"]
        if kind in ("formed", "steps"):
            getattr(worker, kind).append(record)
        elif kind in ("init", "failed", "done"):
            setattr(worker, kind, record)
    return workers


# ---- the checks -----------------------------------------------------------------------
def evaluate(records: list[dict], expect: Expectation, exit_code: int | None,
             wall_s: float) -> list[Check]:
    """One Check per promise of in-process re-formation, from what the workers wrote."""
    workers = by_worker(records)
    rounds = [f["round"] for w in workers.values() for f in w.formed]
    first = min(rounds) if rounds else None
    starters = [w for w in workers.values() if w.formed and w.formed[0]["round"] == first]
    pairs = [(w, w.formed[0], w.formed[-1]) for w in starters]
    return [
        _workers_started(starters, expect),
        _backend(starters, expect),
        _first_collective(starters),
        _failure_injected(starters, first),
        _nccl_aborted(starters, first, expect),
        _kept_processes(workers, starters),
        _next_round(pairs),
        _new_group(pairs),
        _world_size(pairs, expect),
        _device_kept(pairs),
        _state_sent(pairs, expect),
        _finished(workers, expect, exit_code),
        _in_time(pairs, expect, wall_s),
    ]


def _ranks(formed: Iterable[dict]) -> list[int]:
    return sorted(f["rank"] for f in formed)


def _workers_started(starters: list[Worker], expect: Expectation) -> Check:
    ranks = _ranks(w.formed[0] for w in starters)
    ok = ranks == list(range(expect.world))
    return Check("workers started", ok, f"ranks {ranks} in the first round" + (
        "" if ok else f", expected {expect.world} worker(s)"))


def _backend(starters: list[Worker], expect: Expectation) -> Check:
    seen = sorted({str(w.formed[0]["backend"]) for w in starters})
    ok = bool(starters) and seen == [expect.backend]
    return Check("backend", ok, f"{', '.join(seen) or 'none'} (expected {expect.backend})")


def _first_collective(starters: list[Worker]) -> Check:
    """An all-reduce right after er.init(): on NCCL, the communicator was created."""
    missing = [w.pid for w in starters if w.init is None
               or w.init.get("first_collective_s") is None
               or w.formed[0].get("collective_s") is None]
    ok = bool(starters) and not missing
    return Check("first collective", ok, "an all-reduce completed on every rank" if ok
                 else f"no collective completed in pid(s) {missing or 'any'}")


def _failure_injected(starters: list[Worker], first: int | None) -> Check:
    hit = [w for w in starters if w.failed and w.failed["round"] == first]
    ok = bool(starters) and len(hit) == len(starters)
    step = hit[0].failed["step"] if hit else None
    return Check("collective failure injected", ok, f"every rank failed at step {step}" if ok
                 else f"{len(hit)} of {len(starters)} rank(s) reached the failure")


def _nccl_aborted(starters: list[Worker], first: int | None, expect: Expectation) -> Check:
    """On NCCL the failure is the broken round's: communicators aborted from another
    thread, after which an all-reduce raised DistBackendError (not merely any error)."""
    name = "communicator abort"
    if expect.backend != "nccl":
        return Check(name, True, f"not applicable to {expect.backend}")
    hit = [w.failed for w in starters if w.failed and w.failed["round"] == first]
    bad = [f"rank {f.get('rank')}: {f.get('nccl_aborted')} group(s) aborted, "
           f"then {f.get('raised') or 'no error'}" for f in hit
           if not f.get("nccl_aborted") or f.get("raised") != "DistBackendError"]
    ok = bool(hit) and len(hit) == len(starters) and not bad
    return Check(name, ok, "every rank's all-reduce raised DistBackendError after the abort"
                 if ok else "; ".join(bad) or "no rank reached the failure")


def _kept_processes(workers: dict[int, Worker], starters: list[Worker]) -> Check:
    """In place: every first-round process trained in a later round too, and no
    process appeared later (a newcomer here means the restart path was taken)."""
    stayed = [w for w in starters if len({f["round"] for f in w.formed}) > 1]
    newcomers = sorted(pid for pid, w in workers.items() if w.formed and w not in starters)
    ok = bool(starters) and len(stayed) == len(starters) and not newcomers
    detail = f"{len(stayed)} of {len(starters)} process(es) kept their pid"
    if newcomers:
        detail += f"; new process(es) {newcomers}: the restart path was taken"
    return Check("re-formed in place", ok, detail)


def _next_round(pairs: list[tuple[Worker, dict, dict]]) -> Check:
    moves = sorted({(a["round"], b["round"]) for _, a, b in pairs})
    ok = bool(pairs) and all(b > a for a, b in moves)
    return Check("round increased", ok, ", ".join(f"{a} -> {b}" for a, b in moves) or "none")


def _new_group(pairs: list[tuple[Worker, dict, dict]]) -> Check:
    """A new group object; on NCCL also a new communicator (ProcessGroupNCCL.uid)."""
    stale = [w.pid for w, a, b in pairs if b is a or b.get("new_group") is not True
             or (a.get("nccl_uid") is not None and a.get("nccl_uid") == b.get("nccl_uid"))]
    uids = [(a.get("nccl_uid"), b.get("nccl_uid")) for _, a, b in pairs]
    ok = bool(pairs) and not stale
    detail = "every rank formed a new process group"
    if any(u is not None for pair in uids for u in pair):
        detail += "; NCCL uid " + ", ".join(f"{a} -> {b}" for a, b in uids)
    return Check("new communicator", ok, detail if ok else f"old group kept in pid(s) {stale}")


def _world_size(pairs: list[tuple[Worker, dict, dict]], expect: Expectation) -> Check:
    ranks = _ranks(b for _, _, b in pairs)
    worlds = sorted({b["world"] for _, _, b in pairs})
    ok = worlds == [expect.world] and ranks == list(range(expect.world))
    return Check("world size", ok, f"{worlds} after re-forming, ranks {ranks} "
                 f"(expected {expect.world})")


def _device_kept(pairs: list[tuple[Worker, dict, dict]]) -> Check:
    """torch.cuda.current_device() (and the context's device) the same after re-forming."""
    moved = [w.pid for w, a, b in pairs
             if (a["device"], a.get("cuda_device")) != (b["device"], b.get("cuda_device"))]
    unseen = [w.pid for w, a, b in pairs if b is a]
    where = ", ".join(f"{a['device']}" + (f" (current_device {a['cuda_device']})"
                                          if a.get("cuda_device") is not None else "")
                      for _, a, _ in pairs)
    ok = bool(pairs) and not moved and not unseen
    detail = (where if ok else f"pid(s) {moved} changed device" if moved
              else f"pid(s) {unseen or 'none'} never re-formed: nothing to compare")
    return Check("device binding kept", ok, detail)


def _state_sent(pairs: list[tuple[Worker, dict, dict]], expect: Expectation) -> Check:
    """Every rank but 0 lost its state at the failure; after re-forming, rank 0's
    reached them (State.sync's buckets: on NCCL through the GPU) and every rank holds
    the same parameters. A world of one has nobody to send to."""
    later = [b for w, a, b in pairs if b is not a]
    sums = {round(b.get("checksum") or 0.0, 3) for b in later}
    behind = [b for b in later if b["rank"] > 0]
    missed = sorted(b["rank"] for b in behind
                    if not b.get("received") or b.get("sync_source") != 0)
    ok = bool(later) and len(later) == expect.world and len(sums) == 1 and not missed
    if expect.world == 1 and ok:
        return Check("state sent to ranks behind", True, "one rank: nobody behind")
    got = sum(b.get("received") or 0 for b in behind)
    detail = (f"{len(behind)} rank(s) received {got} bytes from rank 0; "
              f"{len(sums)} distinct parameter checksum(s)")
    if missed:
        detail += f"; rank(s) {missed} received nothing from rank 0"
    return Check("state sent to ranks behind", ok, detail)


def _finished(workers: dict[int, Worker], expect: Expectation, exit_code: int | None) -> Check:
    last = sorted({w.done["last_step"] for w in workers.values() if w.done})
    ok = exit_code == 0 and bool(workers) and last == [expect.steps] and all(
        w.done for w in workers.values())
    code = "timed out" if exit_code is None else f"exited {exit_code}"
    return Check("training finished", ok, f"elastic-run {code}; last step {last} "
                 f"(expected {expect.steps})")


def _in_time(pairs: list[tuple[Worker, dict, dict]], expect: Expectation,
             wall_s: float) -> Check:
    pauses = [pause_s(w, b) for w, _, b in pairs]
    pause = max(pauses) if pauses and None not in pauses else None  # every rank's known
    ok = wall_s <= expect.budget_s and pause is not None and pause <= expect.pause_bound_s
    shown = "unknown" if pause is None else f"{pause:.2f} s"
    return Check("within time", ok, f"run {wall_s:.1f} s (at most {expect.budget_s:g}), pause "
                 f"{shown} (at most {expect.pause_bound_s:g})")


def pause_s(worker: Worker, later: dict) -> float | None:
    """Injected failure -> first collective done in the new group, in one process."""
    if worker.failed is None or later.get("round") == worker.failed["round"]:
        return None
    return later["t"] - worker.failed["t"]


# ---- timings and the report ------------------------------------------------------------
def _slowest(values: Iterable[float | None]) -> float | None:
    """The slowest rank's value: the job waits for it."""
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _per_step_ms(records: Iterable[dict]) -> float | None:
    rates = [1000 * r["steps_s"] / r["steps"] for r in records if r and r.get("steps")]
    return _slowest(rates)


def timings(records: list[dict], wall_s: float) -> list[tuple[str, float | None, str]]:
    """(label, value, unit) for the report; None where the run never got there."""
    workers = list(by_worker(records).values())
    later = [(w, w.formed[-1]) for w in workers if len(w.formed) > 1]
    return [
        ("er.init (process group formed)", _slowest(w.init and w.init["init_s"]
                                                    for w in workers), "s"),
        ("first collective after er.init (on NCCL: creates the communicator)",
         _slowest(w.init and w.init.get("first_collective_s") for w in workers), "s"),
        ("step before the failure", _per_step_ms(w.failed for w in workers), "ms"),
        ("re-formation pause (failure -> new group's first collective)",
         _slowest(pause_s(w, b) for w, b in later), "s"),
        ("state sync after re-forming (ranks behind get rank 0's state)",
         _slowest(b.get("sync_s") for _, b in later), "s"),
        ("an all-reduce as the new round's training starts",
         _slowest(b.get("collective_s") for _, b in later), "s"),
        ("step after re-forming", _per_step_ms(s for w in workers for s in w.steps), "ms"),
        ("elastic-run, start to exit", wall_s, "s"),
    ]


def format_report(checks: list[Check], times: list[tuple[str, float | None, str]]) -> str:
    width = max(len(check.name) for check in checks)
    lines = [f"{'PASS' if c.ok else 'FAIL'}  {c.name:<{width}}  {c.detail}" for c in checks]
    for label, value, unit in times:
        shown = "-" if value is None else (f"{value:.1f} ms" if unit == "ms"
                                           else f"{value:.3f} s")
        lines.append(f"time  {label}: {shown}")
    failed = [c.name for c in checks if not c.ok]
    lines.append(f"gpu_check: {len(checks) - len(failed)} of {len(checks)} checks passed"
                 + (f"; failed: {', '.join(failed)}" if failed else ""))
    return "\n".join(lines)


# ---- a --prewarm interpreter on this machine -------------------------------------------
# Run in a waiting interpreter (worker/prewarm.py) before anything touches CUDA: what it
# imported ahead, and whether that import made a CUDA context. A context would hold GPU
# memory beside the worker training on that GPU for as long as the interpreter waits.
PREWARM_PROBE = """import json, os, shutil, subprocess, sys
import torch
smi = shutil.which("nvidia-smi")
holders = None
if smi:
    listed = subprocess.run([smi, "--query-compute-apps=pid", "--format=csv,noheader"],
                            capture_output=True, text=True, timeout=30).stdout.split()
    holders = [int(pid) for pid in listed if pid.isdigit()]
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules,
                  "cuda_initialized": torch.cuda.is_initialized(),
                  "holds_gpu": None if holders is None else os.getpid() in holders}))
"""
PREWARM_CHECK = "waiting interpreter (--prewarm)"


def probe_warm_interpreter(workdir: Path, env: dict[str, str],
                           timeout_s: float = 120.0) -> dict:
    """Start a waiting interpreter as the agent does and hand it the probe; its answer,
    or {"error": why} (its last line of stderr, or the timeout): a GPU machine is lent
    for minutes, so a failed probe must say why in the report."""
    from elastic_runner.contract import PREWARM_MODULE, PYTHON_ENTRY

    probe = workdir / "prewarm_probe.py"
    probe.write_text(PREWARM_PROBE)
    waiting = subprocess.Popen([*PYTHON_ENTRY, "-m", PREWARM_MODULE], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    order = json.dumps({"argv": [str(probe)], "env": env}) + "\n"
    try:
        out, err = waiting.communicate(order.encode(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        waiting.kill()
        waiting.wait()
        return {"error": f"no answer within {timeout_s:g} s"}
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        said = err.decode(errors="replace").strip().splitlines()
        return {"error": f"exit {waiting.returncode}: " + (said[-1] if said else "no output")}


def prewarm_check(answer: dict) -> Check:
    if "error" in answer:
        return Check(PREWARM_CHECK, False, f"the waiting interpreter gave no answer "
                                           f"({answer['error']})")
    if not answer.get("dynamo"):
        return Check(PREWARM_CHECK, False, "torch._dynamo was not imported ahead")
    if answer.get("cuda_initialized") or answer.get("holds_gpu"):
        return Check(PREWARM_CHECK, False, "it made a CUDA context while waiting (GPU memory "
                                           "held beside the worker training on that GPU)")
    seen = {None: "nvidia-smi not found", False: "nvidia-smi lists no context of it"}
    return Check(PREWARM_CHECK, True, "torch and torch._dynamo imported, torch.cuda not "
                                      f"initialised; {seen[answer.get('holds_gpu')]}")


# ---- this machine and the run ------------------------------------------------------------
def visible_gpus() -> int:
    """GPUs this torch can use; CannotRun (with the reason) when there are none."""
    import torch
    import torch.distributed as dist

    if torch.version.cuda is None:
        raise CannotRun(f"torch {torch.__version__} is a CPU-only build: no GPU can be used "
                        "(install a CUDA build of torch in .venv)")
    count = torch.cuda.device_count()
    if count == 0:
        raise CannotRun(f"no GPU visible (torch {torch.__version__}, CUDA "
                        f"{torch.version.cuda}, CUDA_VISIBLE_DEVICES="
                        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})")
    if not dist.is_nccl_available():
        raise CannotRun(f"torch {torch.__version__} has no NCCL backend")
    return count


def etcd_available() -> None:
    """elastic-run --standalone starts an embedded etcd: CannotRun without its binary."""
    from elastic_runner.errors import EtcdBinaryNotFound
    from elastic_runner.etcd.server import find_etcd_binary

    try:
        find_etcd_binary()
    except EtcdBinaryNotFound as error:
        raise CannotRun(str(error)) from None


def job_command(args: argparse.Namespace, out: Path, logs: Path) -> list[str]:
    return [sys.executable, "-m", "elastic_runner", "--standalone",
            "--nproc-per-node", str(args.nproc), "--run-id", f"gpu-check-{os.getpid()}",
            "--settle", "0.2", "--log-dir", str(logs), str(WORKER), "--out", str(out),
            "--steps", str(args.steps), "--fail-at", str(args.fail_at)]


def run_job(command: list[str], env: dict[str, str], log: Path,
            timeout_s: float) -> tuple[int | None, float]:
    """elastic-run's exit code (None: stopped at `timeout_s`) and its wall time."""
    began = time.monotonic()
    with open(log, "wb") as output:
        job = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            code: int | None = job.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            os.killpg(job.pid, signal.SIGKILL)  # the agent's session: its workers too
            job.wait()
    return code, time.monotonic() - began


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="auto", help="workers: 'auto' (one per GPU) or N")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fail-at", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds for the job")
    parser.add_argument("--pause-bound", type=float, default=60.0,
                        help="longest acceptable re-formation pause, seconds")
    parser.add_argument("--workdir", type=Path, help="default: a new temporary folder")
    parser.add_argument("--cpu", action="store_true",
                        help="dry run on gloo with the GPUs hidden (for tests)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = dict(os.environ)
    try:
        if args.cpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
            world = 1 if args.nproc == "auto" else int(args.nproc)
        else:
            gpus = visible_gpus()
            world = gpus if args.nproc == "auto" else int(args.nproc)
            print(f"gpu_check: {gpus} GPU(s) visible; {world} worker(s)", flush=True)
        etcd_available()
    except CannotRun as why:
        print(f"gpu_check: cannot run here: {why}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out, log = workdir / "workers.jsonl", workdir / "elastic-run.log"
    print(f"gpu_check: logs in {workdir}", flush=True)
    code, wall = run_job(job_command(args, out, workdir / "logs"), env, log, args.timeout)
    records = parse_records(out.read_text().splitlines() if out.exists() else [])
    expect = Expectation(world, "gloo" if args.cpu else "nccl", args.steps,
                         args.timeout, args.pause_bound)
    visible = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]  # as for local rank 0
    warm_env = {**env, "CUDA_VISIBLE_DEVICES": visible}
    checks = evaluate(records, expect, code, wall) + [
        prewarm_check(probe_warm_interpreter(workdir, warm_env))]
    print(format_report(checks, timings(records, wall)), flush=True)
    if not all(check.ok for check in checks):
        tail = log.read_text(errors="replace").splitlines()[-25:] if log.exists() else []
        print("--- last lines of elastic-run's output\n" + "\n".join(tail), flush=True)
        return EXIT_FAILED
    return EXIT_PASSED


if __name__ == "__main__":
    sys.exit(main())
