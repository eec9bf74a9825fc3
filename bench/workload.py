"""The one training script both launchers run in every benchmark.

Plain torch.distributed (gloo, env:// rendezvous), so it runs unmodified under
torchrun and elastic-run. A small MLP, data-parallel with a constant per-rank
batch (samples per step = --local-batch x world). Rank 0 writes a checkpoint
every --every steps (temp file + fsync + atomic rename); every rank resumes from
it. One JSON line per step per rank goes to --out:

    {"kind": "step", "t", "step", "rank", "world", "restart", "round", "pid", "ppid", "samples"}

and one {"kind": "start", ...} line per process with the time the interpreter
started the script, finished importing torch, and joined the process group
(the pieces of a restart's cost).

--ckpt picks the script style (issue 13's "script style" dimension), all only
meaningful under elastic-run except plain:
  plain        torch only: its own torch.save checkpoint every --every steps
  er           er.Checkpointer driven by `if ckpt.due(step): ckpt.save(...)`
  er-cadence   er.ElasticSampler + er.Checkpointer saving on its own cadence
               (`step % every == 0`, the objects themselves), never calling due()
  er-sampler   er.ElasticSampler, no checkpointer
  er-inproc    er.State + @er.elastic: workers survive a resize in their own process
               (issue 15); an er.Checkpointer on its cadence keeps durable copies
"""

import time

T_PROC = time.time()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

T_TORCH = time.time()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--every", type=int, default=20, help="checkpoint interval in steps")
    ap.add_argument("--steps", type=int, default=0, help="stop after this step (0: never)")
    ap.add_argument("--step-time", type=float, default=0.05, help="extra sleep per step (s)")
    ap.add_argument("--local-batch", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ckpt", choices=("plain", "er", "er-cadence", "er-sampler", "er-inproc"),
                    default="plain")
    ap.add_argument("--defer-group", action="store_true",
                    help="er-inproc: er.init(defer_group=True), the group formed at train()")
    ap.add_argument("--loader-workers", type=int, default=0,
                    help="batches made by this many DataLoader worker processes per rank "
                         "(er-inproc: er.ElasticDataLoader; plain and er: a torch DataLoader)")
    ap.add_argument("--boot-delay", type=float, default=0.0,
                    help="seconds slept once the model is built, before the checkpoint and "
                         "the first step: a GPU job's model build and CUDA start (start_join.py)")
    args = ap.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    rnd = os.environ.get("ELASTIC_RUN_ROUND", "")
    ckpt = None
    if args.ckpt != "plain":
        import elastic_runner as er
        er.init(timeout_s=60, defer_group=args.defer_group)
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    t_pg = time.time()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.dim, 128), torch.nn.Tanh(),
                                torch.nn.Linear(128, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # The script's own boot, which no launcher can skip on a fresh node: import torch,
    # and building the model and optimizer (the first optimizer imports torch._dynamo:
    # torch._compile._disable_dynamo). spot_replay.py's boot ceiling counts both.
    boot = {"t_proc": T_PROC, "t_torch": T_TORCH, "model_s": time.time() - t_pg}
    if args.boot_delay:  # every worker that got this far, restarted or not (start_join.py)
        with open(args.out, "a") as out:
            out.write(json.dumps({"kind": "booted", "t": time.time(), "pid": os.getpid()}) + "\n")
        time.sleep(args.boot_delay)
    start_step = 0
    path = os.path.join(args.ckpt_dir, "ckpt.pt")
    if args.ckpt in ("er-cadence", "er-sampler"):
        run_with_sampler(args, model, opt, rank, world, restart, rnd, boot)
        return
    if args.ckpt == "er-inproc":
        run_in_process(args, model, opt, t_pg, boot)
        return
    if args.ckpt == "er":
        import elastic_runner as er
        ckpt = er.Checkpointer(args.ckpt_dir, keep=2, every=args.every)
        state = ckpt.load_latest()
    else:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        state = torch.load(path, weights_only=True) if os.path.exists(path) else None
    if state:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start_step = int(state["step"]) + 1
    gen = torch.Generator().manual_seed(1000 + rank)
    inputs = loaded_rows(args, gen) if args.loader_workers else None
    out = open(args.out, "a", buffering=1)
    common = {"rank": rank, "world": world, "restart": restart, "round": rnd,
              "pid": os.getpid(), "ppid": os.getppid()}
    out.write(json.dumps({"kind": "start", **boot, "t_pg": t_pg,
                          "resume_step": start_step, **common}) + "\n")
    step = start_step
    while not args.steps or step <= args.steps:
        x = next(inputs) if inputs else torch.randn(args.local_batch, args.dim, generator=gen)
        train_step(model, opt, x, world)
        log_step(out, args, step, world, common)
        if ckpt is not None:
            if ckpt.due(step):
                ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(),
                                 "step": step})
        elif rank == 0 and args.every and step % args.every == 0:
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                            "step": step}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        step += 1
    if ckpt is not None:
        ckpt.close()
    dist.destroy_process_group()


def loaded_rows(args, gen: torch.Generator):
    """Batches of RandomRows drawn at random by a torch DataLoader's worker processes,
    as a restart-path script loads its data."""
    rows = RandomRows(SAMPLER_SAMPLES, args.dim)
    draw = torch.utils.data.RandomSampler(rows, replacement=True, num_samples=10 ** 9,
                                          generator=gen)
    return iter(torch.utils.data.DataLoader(rows, batch_size=args.local_batch, sampler=draw,
                                            num_workers=args.loader_workers))


def train_step(model, opt, x, world: int) -> None:
    """One data-parallel step: mean gradient over the world, then the update."""
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), torch.tanh(x.sum(1, keepdim=True))).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()


def log_step(out, args, step: int, world: int, common: dict) -> None:
    out.write(json.dumps({"kind": "step", "t": time.time(), "step": step,
                          "samples": args.local_batch * world, **common}) + "\n")
    if args.step_time:
        time.sleep(args.step_time)


def run_with_sampler(args, model, opt, rank, world, restart, rnd, boot: dict) -> None:
    """The sampler styles: steps come from er.ElasticSampler (the runtime's step
    boundary), the batch is --local-batch per rank as in the other styles."""
    import elastic_runner as er

    sampler = er.ElasticSampler(SAMPLER_SAMPLES, global_batch_size=args.local_batch,
                                policy="constant-local", shuffle=False)
    objects = {"model": model, "optim": opt, "sampler": sampler}
    ckpt = er.Checkpointer(args.ckpt_dir, keep=2) if args.ckpt == "er-cadence" else None
    start_step = (ckpt.restore(objects) or 0) if ckpt is not None else 0
    gen = torch.Generator().manual_seed(1000 + rank)
    out = open(args.out, "a", buffering=1)
    common = {"rank": rank, "world": world, "restart": restart, "round": rnd,
              "pid": os.getpid(), "ppid": os.getppid()}
    out.write(json.dumps({"kind": "start", **boot, "t_pg": time.time(),
                          "resume_step": start_step + 1, **common}) + "\n")
    for step, indices in sampler:
        train_step(model, opt, torch.randn(len(indices), args.dim, generator=gen), world)
        log_step(out, args, step, world, common)
        if ckpt is not None and args.every and step % args.every == 0:
            ckpt.save(step, objects)
        if args.steps and step >= args.steps:
            break
    er.finish()


def run_in_process(args, model, opt, t_pg: float, boot: dict) -> None:
    """The in-process style: one process for the whole run; rank, world size and round
    are read from the runtime at every step because a re-formation changes them."""
    import elastic_runner as er

    sampler = er.ElasticSampler(SAMPLER_SAMPLES, global_batch_size=args.local_batch,
                                policy="constant-local", shuffle=False)
    state = er.State(model=model, optim=opt, sampler=sampler)
    ckpt = er.Checkpointer(args.ckpt_dir, keep=2)
    start_step = state.restore(ckpt)
    loader = er.ElasticDataLoader(RandomRows(SAMPLER_SAMPLES, args.dim), sampler,
                                  num_workers=args.loader_workers) if args.loader_workers else None
    out = open(args.out, "a", buffering=1)
    ctx = er.current()
    out.write(json.dumps({"kind": "start", **boot, "t_pg": t_pg,
                          "resume_step": (start_step or -1) + 1, **dynamic(ctx)}) + "\n")

    @er.elastic(state)
    def train(state):
        sync = state.last_sync  # what this (re-)formation moved to bring the ranks level
        if sync is not None:
            out.write(json.dumps({"kind": "sync", "t": time.time(), "step": sync.step,
                                  "received": sync.received, "seconds": sync.seconds,
                                  **dynamic(ctx)}) + "\n")
        gen = torch.Generator().manual_seed(1000 + ctx.rank)
        batches = loader if loader is not None else (
            (step, torch.randn(len(indices), args.dim, generator=gen))
            for step, indices in sampler)
        for step, x in batches:
            train_step(model, opt, x, ctx.world_size)
            log_step(out, args, step, ctx.world_size, dynamic(ctx))
            if args.every and step % args.every == 0:
                ckpt.save(step, state)
            if args.steps and step >= args.steps:
                return

    train()
    er.finish()


class RandomRows(torch.utils.data.Dataset):
    """Row i: `dim` numbers drawn from seed i, made in a loader's worker process."""

    def __init__(self, rows: int, dim: int):
        self.rows, self.dim = rows, dim

    def __len__(self):
        return self.rows

    def __getitem__(self, index):
        return torch.randn(self.dim, generator=torch.Generator().manual_seed(index))


def dynamic(ctx) -> dict:
    return {"rank": ctx.rank, "world": ctx.world_size, "restart": str(ctx.restart_count),
            "round": str(ctx.round), "pid": os.getpid(), "ppid": os.getppid()}


# Enough for any benchmark run (~50 steps/s); unshuffled, the order costs one list.
SAMPLER_SAMPLES = 1_000_000


if __name__ == "__main__":
    main()
