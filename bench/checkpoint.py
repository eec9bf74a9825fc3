"""Sharded vs rank-0 checkpoints of one FSDP2 model: save, blocked loop, restore, memory.

The model is examples/train_fsdp.py's MLP made wide (--hidden 4096, 3 hidden layers:
33.7M parameters, 404 MB with Adam's two moments), sharded with FSDP2 over 4 local
gloo ranks that this script forks after importing torch (no agents, no etcd: the
Checkpointer runs with no latest_store, so the times are storage and torch only).

At world 4, after one training step (so Adam has state), each variant saves once:
- sharded: `er.Checkpointer(sharded=True)`, `save(step, {"model", "optim"})`; every
  rank writes its own shards (torch.distributed.checkpoint), hashes them, rank 0
  writes the manifest;
- rank-0: what the rank-0 format needs for a sharded model: every rank gathers the full
  model and optimizer state onto rank 0 (torch's get_*_state_dict(full_state_dict,
  cpu_offload), a collective), then rank 0 alone writes one torch.save file;
each sync (`async_save=False`) and async. "blocked" is how long the training loop
stands still (the slowest rank's save() call, the gather included for rank-0);
"durable" is until the checkpoint is written, read back, hashed and committed (save()
then wait(): nothing overlaps the write here, so on 2 cores async is not cheaper in
total, only in blocked time).

Then ranks 0-1 form world 2, build the model afresh and restore each checkpoint:
sharded through `restore(objects)` (DCP reshards; each rank verifies half the files);
rank-0 through `load_latest()` on every rank (each reads and hashes the whole file)
and set_*_state_dict(full_state_dict=True). A fingerprint of the full parameters
(train_fsdp.fingerprint) must equal the saved one, or the row says so.

Peak memory: rank 0's peak resident set (VmHWM in /proc/self/status), reset before each
measurement by writing 5 to /proc/self/clear_refs, as MiB above its resident set just
before (what the checkpoint cost), and in total. The checkpoint files are in the page
cache when restored (a fresh node reading from remote storage would be slower).

    .venv/bin/python bench/checkpoint.py                     # 2 repeats, ~8 min on 2 cores
    .venv/bin/python bench/checkpoint.py --hidden 256 --repeats 1   # a 1-minute check
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c  # noqa: E402

sys.path.insert(0, str(c.ROOT / "examples"))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import train_fsdp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    set_model_state_dict, set_optimizer_state_dict)

import elastic_runner as er  # noqa: E402

VARIANTS = (("sharded", False), ("sharded", True), ("rank-0", False), ("rank-0", True))
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
STEP = 1  # Adam has state after one step


def name_of(fmt: str, asynchronous: bool) -> str:
    return f"{fmt} {'async' if asynchronous else 'sync'}"


# ---- memory of this process -------------------------------------------------------------
def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def reset_peak() -> int:
    """Start a new peak-RSS window; return the resident set now, MiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") // 1024


def peak_mib() -> int:
    return _status_kib("VmHWM") // 1024


# ---- the model ----------------------------------------------------------------------
def build(args):
    model = train_fsdp.shard(train_fsdp.build_model(args.dim, args.hidden, args.layers))
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def train(model, optim, steps: int, args) -> None:
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        inputs = torch.randn(args.batch, args.dim, generator=generator)
        model(inputs).square().mean().backward()
        optim.step()
        optim.zero_grad()


# ---- world 4: save --------------------------------------------------------------------
def checkpointer(root: Path, fmt: str, asynchronous: bool, saving: bool = True):
    """The variant's Checkpointer; a restore opens the same folder without async_save."""
    return er.Checkpointer(root / name_of(fmt, asynchronous).replace(" ", "-"),
                           sharded=fmt == "sharded", keep=1,
                           async_save=asynchronous and saving)


def save_once(ckpt, fmt: str, step: int, model, optim) -> tuple[float, float]:
    """(seconds the loop was blocked, seconds until durable) on this rank."""
    dist.barrier()
    started = time.perf_counter()
    if fmt == "sharded":
        ckpt.save(step, {"model": model, "optim": optim})
    else:
        state = {"model": get_model_state_dict(model, options=FULL),
                 "optim": get_optimizer_state_dict(model, optim, options=FULL)}
        ckpt.save(step, state)  # rank 0 writes; the others return at once
        del state
    blocked = time.perf_counter() - started
    ckpt.wait()
    return blocked, time.perf_counter() - started


def rank_save(args, fmt: str, asynchronous: bool, root: Path) -> dict:
    """Train, save (the first save of a process pays one-time costs), train a step, save
    again: the second save is the one measured, as in a training run's steady state."""
    model, optim = build(args)
    train(model, optim, STEP, args)
    baseline = reset_peak()
    ckpt = checkpointer(root, fmt, asynchronous)
    first = save_once(ckpt, fmt, STEP, model, optim)
    train(model, optim, 1, args)
    before = reset_peak()
    blocked, durable = save_once(ckpt, fmt, STEP + 1, model, optim)
    peak = peak_mib()
    ckpt.close()
    return {"blocked_s": max(gathered(blocked)), "blocked_rank0_s": blocked,
            "durable_s": durable, "first_save": {"blocked_s": first[0], "durable_s": first[1]},
            "rank0_rss_baseline_mib": baseline, "rank0_rss_before_mib": before,
            "rank0_peak_mib": peak, "fingerprint": train_fsdp.fingerprint(model, dist.get_rank()),
            "parameters": sum(p.numel() for p in model.parameters()),
            "state_bytes": state_bytes(model, optim)}


def state_bytes(model, optim) -> int:
    """Bytes of parameters + optimizer tensors over all ranks (what a checkpoint holds)."""
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    local += sum(v.to_local().numel() * v.element_size() if hasattr(v, "to_local")
                 else v.numel() * v.element_size()
                 for s in optim.state.values() for v in s.values() if torch.is_tensor(v))
    return sum(gathered(local))


def gathered(value) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# ---- world 2: restore -------------------------------------------------------------------
def rank_restore(args, fmt: str, asynchronous: bool, root: Path) -> dict:
    """A fresh process, as after a resize: build, restore, compare."""
    model, optim = build(args)
    ckpt = checkpointer(root, fmt, asynchronous, saving=False)
    dist.barrier()
    baseline = reset_peak()
    started = time.perf_counter()
    if fmt == "sharded":
        step = ckpt.restore({"model": model, "optim": optim})
    else:
        state = ckpt.load_latest()  # every rank reads and verifies the whole file
        step = ckpt.loaded_step
        set_model_state_dict(model, state["model"], options=FULL)
        set_optimizer_state_dict(model, optim, state["optim"], options=FULL)
        del state
    dist.barrier()
    took = time.perf_counter() - started
    peak = peak_mib()
    ckpt.close()
    return {"restore_s": took, "restored_step": step, "rank0_rss_baseline_mib": baseline,
            "rank0_peak_mib": peak, "fingerprint": train_fsdp.fingerprint(model, dist.get_rank())}


# ---- the ranks ---------------------------------------------------------------------------
def rank_main(index: int, work: str, phase: str, world: int, port: int, args, variant) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index,
                            world_size=world, timeout=datetime.timedelta(seconds=900))
    run = rank_save if phase == "save" else rank_restore
    result = run(args, *variant, Path(work) / "ckpt")
    if index == 0:
        (Path(work) / f"{phase}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def measure(args, variant: tuple[str, bool]) -> tuple[dict, dict, int]:
    """Fork 4 ranks that save, then 2 fresh ones that restore; remove the files."""
    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    try:
        (work / "ckpt").mkdir()
        out = []
        for phase, world in (("save", 4), ("restore", 2)):
            mp.start_processes(rank_main, nprocs=world, start_method="fork",
                               args=(str(work), phase, world, c.free_port(), args, variant))
            out.append(json.loads((work / f"{phase}.json").read_text()))
        return out[0], out[1], dir_bytes(work / "ckpt")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# ---- output -------------------------------------------------------------------------------
def row(name: str, runs: list[dict]) -> list[str]:
    """One variant over the repeats: median [min-max] of times, median of memory."""
    def stat(phase, key):
        return c.mmm([run[phase][key] for run in runs])

    def mib(phase):
        grown = stat(phase, "rank0_peak_mib")["median"] - stat(
            phase, "rank0_rss_baseline_mib")["median"]
        return f"+{grown:.0f} MiB ({stat(phase, 'rank0_peak_mib')['median']:.0f} MiB)"

    same = all(run["restore"]["fingerprint"] == run["save"]["fingerprint"]
               and run["restore"]["restored_step"] == STEP + 1 for run in runs)
    return [name, c.fmt(stat("save", "durable_s"), digits=2),
            c.fmt(stat("save", "blocked_s"), digits=2), mib("save"),
            c.fmt(stat("restore", "restore_s"), digits=2), mib("restore"),
            f"{runs[0]['bytes'] / 2**20:.0f} MiB", "yes" if same else "NO"]


def render(args, results: dict, env: dict) -> str:
    first = next(iter(results.values()))[0]["save"]
    head = (f"checkpoint: FSDP2 MLP, {first['parameters'] / 1e6:.1f}M parameters (hidden "
            f"{args.hidden} x {args.layers}), Adam: {first['state_bytes'] / 2**20:.0f} MiB of "
            "state; saved at world 4, restored at world 2 (gloo, local disk, no latest_store); "
            f"{args.repeats} repeat(s), median [min-max]\n"
            f"{env['date_utc']} UTC, {env['cores']} cores, torch {env['torch']}, load "
            f"{env.get('loadavg_at_start', (float('nan'),))[0]:.1f}\n")
    headers = ["variant", "save (durable)", "loop blocked", "rank-0 peak RSS, save",
               "restore at world 2", "rank-0 peak RSS, restore", "on disk", "restored = saved"]
    rows = [row(name, runs) for name, runs in results.items()]
    return head + "\n" + c.table(headers, rows) + (
        "\n\nsave: a process's second save (its first pays one-time costs; in the JSON); "
        "blocked: the slowest rank's save() call, the gather to rank 0 included; peak RSS: "
        "rank 0's VmHWM above its resident set before the first save (restore: before the "
        "restore), the total in brackets")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="variants run in turn, N times")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.time()
    env = c.env_info()
    results = {name_of(*variant): [] for variant in VARIANTS}
    for _ in range(args.repeats):  # A B C D A B C D: the machine's load spread over all
        for variant in VARIANTS:
            saved, restored, on_disk = measure(args, variant)
            results[name_of(*variant)].append(
                {"save": saved, "restore": restored, "bytes": on_disk})
    table = render(args, results, env)
    print(table)
    print(f"wall time {time.time() - started:.0f}s")
    path = c.save("checkpoint", {"env": env, "args": vars(args), "results": results}, table)
    print(f"wrote {path.relative_to(c.ROOT)} and bench/latest/checkpoint.json")


if __name__ == "__main__":
    main()
