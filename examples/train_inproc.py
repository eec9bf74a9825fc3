"""The MLP of train_mlp.py, written to survive resizes in its own process.

A membership change (a node lost, a node leaving with notice, a node joining) does
not restart this script: its workers pause at a step boundary, re-form the process
group at the new world size, take the model, optimizer and data position from a peer
that has them (a newcomer) or keep their own (a survivor), and `train()` is called
again. Only the first start of the job, and the loss of every copy, read a checkpoint.

    elastic-run --min-nodes 1 --max-nodes 4 examples/train_inproc.py --steps 300

With --defer-group (er.init(defer_group=True)) the process group forms when train() is
first called, with the ranks current then: nodes that join or leave while the workers
start cost them nothing. With --trace FILE every rank appends two JSON lines per step
(and, with --boot-delay, a "booted" line before that delay). Before its first
collective: the indices it is about to contribute ("began"). After the step: the same
with its pid, world size, round, and a checksum of the parameters (all ranks must agree
on it at every step; the in-process tests check exactly that). Why both: a rank whose
peer dies after the last all-reduce reached some ranks but not it never logs the
step, though the ranks that completed it applied its gradients; such a step counts
with the indices every rank began it with.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import elastic_runner as er
# The same data and model as train_mlp.py (this folder is on sys.path when run as a script).
from train_mlp import build_model, pause, synthetic_dataset


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=0, help="stop after this global step (0: epochs)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-dir", default="runs/inproc-ckpt")
    parser.add_argument("--every", type=int, default=100, help="durable checkpoint cadence (steps)")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra sleep per step")
    parser.add_argument("--trace", help="append one JSON line per step (indices, checksum)")
    parser.add_argument("--fast-file", help="once this file exists, steps skip "
                        "--step-time (a test ends the idle tail of its epoch)")
    parser.add_argument("--defer-group", action="store_true",
                        help="er.init(defer_group=True): the group forms when train() is "
                             "first called, so changes while the workers start cost nothing")
    parser.add_argument("--boot-delay", type=float, default=0.0,
                        help="sleep before train(), as a model that takes long to build")
    parser.add_argument("--loader-workers", type=int, default=0,
                        help="load batches through er.ElasticDataLoader with this many "
                             "worker processes (0: index the tensors in the loop)")
    return parser.parse_args()


class Samples(torch.utils.data.Dataset):
    """Sample i: (i, input, target). A real dataset reads and decodes here, in the
    loader's worker processes."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        self.inputs, self.targets = inputs, targets

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        return index, self.inputs[index], self.targets[index]


def batches(sampler, loader, inputs, targets):
    """(step, indices, inputs, targets) of each step. Through er.ElasticDataLoader the
    sampler's position counts only the batches this loop received, however many its
    workers loaded ahead; a torch DataLoader over the sampler would count those too
    (er.ElasticSampler refuses that)."""
    if loader is not None:
        for step, batch in loader:
            if batch is None:  # this rank's share of the epoch's last batch is empty
                yield step, [], None, None
                continue
            indices, x, y = batch
            yield step, indices.tolist(), x, y
        return
    for step, indices in sampler:
        index = torch.tensor(indices, dtype=torch.long)
        yield step, indices, inputs[index], targets[index]


def checksum(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


def main() -> None:
    args = parse_args()
    er.init(defer_group=args.defer_group)
    inputs, targets = synthetic_dataset(args.samples, args.dim)
    model = build_model(args.dim)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    sampler = er.ElasticSampler(args.samples, global_batch_size=args.global_batch, seed=0)
    state = er.State(model=model, optimizer=optimizer, sampler=sampler)
    ckpt = er.Checkpointer(args.checkpoint_dir, keep=3, every=args.every)
    state.restore(ckpt)
    loader = er.ElasticDataLoader(Samples(inputs, targets), sampler,
                                  num_workers=args.loader_workers) if args.loader_workers else None
    trace = open(args.trace, "a", buffering=1) if args.trace else None
    if args.boot_delay:  # a model that takes long to build: the script is still starting
        if trace:
            trace.write(json.dumps({"booted": os.getpid(), "pid": os.getpid(),
                                    "round": er.current().round}) + "\n")
        time.sleep(args.boot_delay)

    @er.elastic(state)
    def train(state):
        ctx = er.current()
        for epoch in range(sampler.epoch, args.epochs):
            sampler.set_epoch(epoch)
            for step, indices, x, y in batches(sampler, loader, inputs, targets):
                if trace:
                    trace.write(json.dumps({
                        "began": step, "rank": ctx.rank, "round": ctx.round,
                        "pid": os.getpid(), "epoch": epoch, "indices": indices}) + "\n")
                optimizer.zero_grad()
                loss_sum = torch.nn.functional.mse_loss(model(x), y, reduction="sum") \
                    if indices else sum(p.sum() * 0 for p in model.parameters())
                (loss_sum / sampler.batch_plan.global_batch).backward()
                for param in model.parameters():
                    if ctx.world_size > 1:
                        dist.all_reduce(param.grad)
                optimizer.step()
                if trace:
                    trace.write(json.dumps({
                        "step": step, "rank": ctx.rank, "world": ctx.world_size,
                        "round": ctx.round, "pid": os.getpid(), "epoch": epoch,
                        "indices": indices, "checksum": checksum(model),
                        "t": time.time()}) + "\n")
                pause(args.step_time, args.fast_file)
                if ckpt.due(step):
                    ckpt.save(step, state)  # the same names restore() reads back
                if args.steps and step >= args.steps:
                    return step
        return sampler.step

    train()
    er.finish()


if __name__ == "__main__":
    main()
