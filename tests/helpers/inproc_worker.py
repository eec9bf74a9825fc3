"""A worker written with `er.State` + `@er.elastic`, for the in-process re-formation tests.

A tiny DDP model (SGD with momentum, so the optimizer has state to move) trained on
synthetic data through ElasticSampler. Every rank appends JSON lines to its own file
in --trace-dir (named by its pid, which re-formations keep):
- {"kind": "sync", ...}: what State.sync did before each call of train();
- {"kind": "step", ...}: after each step's optimizer step: the indices it trained, its
  rank, world, round, and a hash of the parameters (equal on every rank of a step);
- {"kind": "held", "step"}: it reached --hold-at and waits until --release exists;
- {"kind": "done", ...}: train() returned.
The test plays the agent through each worker's ReformChannel.
"""

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import elastic_runner as er
from elastic_runner.worker import elastic as er_elastic

# The example's dataset and batch loop, so that the tests run what users read.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_inproc import Samples, batches as example_batches  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace-dir", required=True)
    parser.add_argument("--samples", type=int, default=360)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--hold-at", type=int, default=-1, help="wait at this step for --release")
    parser.add_argument("--release", default="")
    parser.add_argument("--ckpt", default="")
    parser.add_argument("--every", type=int, default=0)
    parser.add_argument("--fenced-while", default="",
                        help="the checkpoint record refuses every save while this file exists")
    parser.add_argument("--assignment-timeout", type=float, default=120.0)
    parser.add_argument("--booted", default="",
                        help="create this file once torch is imported, before er.init()")
    parser.add_argument("--no-sampler", action="store_true",
                        help="no ElasticSampler: the loop counts steps and calls state.commit()")
    parser.add_argument("--sampler-outside-state", action="store_true",
                        help="er.State without the loop's sampler (the mistake the first "
                             "re-formation names)")
    parser.add_argument("--scheduler-outside-state", action="store_true",
                        help="a warm-up LR scheduler stepped every step, left out of er.State "
                             "(the mistake the first re-formation names)")
    parser.add_argument("--ddp-before-train", action="store_true",
                        help="wrap the model in DDP before the @er.elastic function (the "
                             "mistake er.elastic answers with the restart path)")
    parser.add_argument("--loader-workers", type=int, default=-1,
                        help="load batches through er.ElasticDataLoader with this many "
                             "worker processes (-1: index the tensors in the loop)")
    parser.add_argument("--persistent-loader", action="store_true",
                        help="the loader's worker processes live through re-formations")
    return parser.parse_args()


def param_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    args = parse_args()
    er_elastic.ASSIGNMENT_TIMEOUT_S = args.assignment_timeout
    if args.booted:
        Path(args.booted).touch()
    er.init()
    trace = open(Path(args.trace_dir) / f"worker-{os.getpid()}.jsonl", "a", buffering=1)

    def log(kind: str, **fields) -> None:
        ctx = er.current()
        trace.write(json.dumps({"kind": kind, "pid": os.getpid(), "rank": ctx.rank,
                                "world": ctx.world_size, "round": ctx.round, **fields}) + "\n")

    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(args.samples, 8, generator=generator)
    targets = torch.randn(args.samples, 2, generator=generator)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = er.ElasticSampler(args.samples, global_batch_size=args.batch, seed=3)
    if args.no_sampler or args.sampler_outside_state:
        state = er.State(model=model, optimizer=optimizer)
    else:
        state = er.State(model=model, optimizer=optimizer, sampler=sampler)
    store = FencedWhile(Path(args.fenced_while)) if args.fenced_while else None
    ckpt = er.Checkpointer(args.ckpt, every=args.every, latest_store=store) if args.ckpt else None
    if ckpt is not None:
        state.restore(ckpt)
    early = DDP(model) if args.ddp_before_train else None
    warm_up = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 50)) \
        if args.scheduler_outside_state else None
    # Made once, as a script whose loader workers live through re-formations does.
    loader = er.ElasticDataLoader(
        Samples(inputs, targets), sampler, num_workers=args.loader_workers,
        persistent_workers=args.persistent_loader) if args.loader_workers >= 0 else None

    @er.elastic(state)
    def train(state):
        sync = state.last_sync
        log("sync", step=state.step, received=sync.received if sync else None,
            source=sync.source if sync else None,
            receivers=list(sync.receivers) if sync else None, hash=param_hash(model))
        ddp = early or DDP(model)
        for step, indices, x, y in batches(args, sampler, state, inputs, targets, loader):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            optimizer.step()
            if warm_up is not None:
                warm_up.step()
            log("step", step=step, indices=indices, hash=param_hash(model))
            if ckpt is not None and ckpt.due(step):
                ckpt.save(step, state)
            if step == args.hold_at:
                log("held", step=step)
                while not os.path.exists(args.release):
                    time.sleep(0.01)
            if args.no_sampler:
                state.commit(step)  # the step boundary of a script without a sampler
        return state.step if args.no_sampler else sampler.step

    last = train()
    log("done", step=last, hash=param_hash(model))
    er.finish()


class FencedWhile:
    """A latest store that refuses every record while `path` exists, as the etcd record
    does once the next round has a plan (checkpoint/etcd_store.py)."""

    def __init__(self, path: Path):
        self.path, self.record = path, er.MemoryLatestStore()

    def read(self):
        return self.record.read()

    def publish(self, record) -> bool:
        return not self.path.exists() and self.record.publish(record)

    def retract(self, bad, replacement) -> bool:
        return not self.path.exists() and self.record.retract(bad, replacement)


def batches(args, sampler, state, inputs, targets, loader):
    """(step, indices, inputs, targets) of each step, loaded the way the flags say."""
    if args.no_sampler:
        for step, indices in counted_steps(state, args):
            index = torch.tensor(indices, dtype=torch.long)
            yield step, indices, inputs[index], targets[index]
        return
    yield from example_batches(sampler, loader, inputs, targets)


def counted_steps(state, args):
    """Steps the script counts itself from the State's last completed one: step s
    trains samples (s-1)*batch .. s*batch-1 in order, split over the ranks of now."""
    import torch.distributed as dist

    while state.step < args.samples // args.batch:
        step = max(state.step, 0) + 1
        rank, world = dist.get_rank(), dist.get_world_size()
        yield step, list(range((step - 1) * args.batch, step * args.batch))[rank::world]


if __name__ == "__main__":
    main()
