"""An MLP sharded with FSDP2 (`fully_shard`), checkpointed sharded: the issue-16 API end to end.

Every rank holds only its shards of the parameters and of the optimizer state, and
writes only those: `er.Checkpointer(..., sharded=True)` saves through
torch.distributed.checkpoint, and `ckpt.restore(objects)` reshards the newest verified
checkpoint into whatever world this round has (saved at 4 ranks, restored at 2, and
back). Runs on CPU (gloo) or GPU (nccl) under elastic-run:

    elastic-run --min-nodes 1 --max-nodes 4 --nproc-per-node 2 examples/train_fsdp.py

The data is train_mlp.py's synthetic regression set, a pure function of the sample
index, and the gradient is the mean over the global batch whatever the world size,
so one run's loss per step is the same at 2, 4 or 6 ranks (up to float rounding):
a resize changes who computes a step, never what it computes.

With --trace FILE every rank appends one JSON line per step (indices, the sum of its
samples' losses) and rank 0 adds a fingerprint of the full, unsharded parameters
(per tensor: sum, sum of squares, a fixed random projection, in float64); one more
line per round says which step restore() loaded and the fingerprint after it. The
e2e tests compare those across world sizes (tests/e2e/test_fsdp.py).
"""

import argparse
import json
import time

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

import elastic_runner as er
# The same data as train_mlp.py (this folder is on sys.path when run as a script).
from train_mlp import synthetic_dataset


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=3, help="hidden layers, one FSDP unit each")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--checkpoint-dir", default="runs/fsdp-ckpt", help="path or fsspec URL")
    parser.add_argument("--every", type=int, default=20, help="checkpoint cadence (steps)")
    parser.add_argument("--sync-save", action="store_true",
                        help="block the loop for the whole write (default: async_save)")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra sleep per step")
    parser.add_argument("--trace", help="append one JSON line per step (indices, loss, "
                                            "fingerprint)")
    return parser.parse_args(argv)


def build_model(dim: int, hidden: int, layers: int) -> torch.nn.Sequential:
    """The unsharded model: identical initial weights on every rank and every run."""
    torch.manual_seed(0)
    widths = [dim] + [hidden] * layers
    blocks = [torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.Tanh())
              for a, b in zip(widths, widths[1:])]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(hidden, 1))


def shard(model: torch.nn.Sequential) -> torch.nn.Sequential:
    """One FSDP unit per block (its parameters are gathered only while it runs), then
    the root for what is left: the usual FSDP2 wrapping."""
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


def fingerprint(model: torch.nn.Module, rank: int) -> list[float] | None:
    """Rank 0: three float64 numbers per parameter tensor of the full model; every rank
    must call it (it gathers the shards). Equal fingerprints at two world sizes mean the
    same parameters: a projection on fixed random weights moves with any changed value."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    if rank != 0:
        return None
    out = []
    for index, name in enumerate(sorted(full)):
        value = full[name].detach().double().flatten()
        weights = torch.randn(value.numel(), generator=torch.Generator().manual_seed(index),
                              dtype=torch.float64)
        out += [value.sum().item(), (value * value).sum().item(), (value @ weights).item()]
    return out


def train_step(model, optimizer, inputs, targets, indices, global_batch, world) -> float:
    """One step on this rank's share; returns the sum of its samples' losses.

    FSDP2 averages gradients over the ranks, so scaling this rank's loss sum by
    world / global_batch makes the result the mean over the global batch (exact for
    uneven shares too; for world sizes that are powers of two the scaling is exact)."""
    optimizer.zero_grad()
    batch = torch.tensor(indices, dtype=torch.long)
    loss_sum = torch.nn.functional.mse_loss(model(inputs[batch]), targets[batch], reduction="sum")
    (loss_sum * (world / global_batch)).backward()
    optimizer.step()
    return loss_sum.item()


def main(argv=None) -> None:
    args = parse_args(argv)
    ctx = er.init()
    inputs, targets = synthetic_dataset(args.samples, args.dim)
    model = shard(build_model(args.dim, args.hidden, args.layers))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)  # after sharding: DTensors
    sampler = er.ElasticSampler(args.samples, global_batch_size=args.global_batch, seed=0)
    objects = {"model": model, "optim": optimizer, "sampler": sampler}
    ckpt = er.Checkpointer(args.checkpoint_dir, sharded=True, keep=3, every=args.every,
                           async_save=not args.sync_save)
    restored = ckpt.restore(objects)  # resharded into this world, or None
    trace = open(args.trace, "a", buffering=1) if args.trace else None
    log = _logger(trace, ctx)
    log(kind="restore", step=restored, fingerprint=fingerprint(model, ctx.rank) if trace else None)
    if ctx.rank == 0:
        print(f"round {ctx.round}: world {ctx.world_size}, {sampler.batch_plan.describe()}, "
              f"resuming after step {sampler.step}", flush=True)
    for epoch in range(sampler.epoch, args.epochs):
        sampler.set_epoch(epoch)
        for step, indices in sampler:
            loss_sum = train_step(model, optimizer, inputs, targets, indices,
                                  args.global_batch, ctx.world_size)
            if trace:
                log(kind="step", step=step, epoch=epoch, indices=indices, loss_sum=loss_sum,
                    fingerprint=fingerprint(model, ctx.rank))
            if ctx.rank == 0 and step % 10 == 0:
                print(f"step {step} world {ctx.world_size} loss "
                      f"{loss_sum / max(len(indices), 1):.4f}", flush=True)
            if args.step_time:
                time.sleep(args.step_time)
            if ckpt.due(step):
                ckpt.save(step, objects)  # every rank writes its shards; async: returns early
    er.finish()  # waits for the last save; a failed one fails the worker


def _logger(trace, ctx):
    """One JSON line per call with the rank's identity; fingerprints only from rank 0."""
    def log(**row) -> None:
        if trace is None:
            return
        if row.get("fingerprint") is None:
            row.pop("fingerprint", None)
        trace.write(json.dumps({"rank": ctx.rank, "world": ctx.world_size, "round": ctx.round,
                                "t": time.time(), **row}) + "\n")
    return log


if __name__ == "__main__":
    main()
