"""A small MLP on a synthetic regression task: the elastic-run API end to end.

Runs on CPU (gloo) or GPU (nccl) under elastic-run; resumes from the newest
checkpoint after every resize with its data position and batch policy intact.

    elastic-run --min-nodes 1 --max-nodes 4 examples/train_mlp.py --steps 300

Logs one line per step (step, world size, loss, samples/s); with --trace FILE it
also appends every sample index it trains on (used by the exactly-once tests).
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import elastic_runner as er


def synthetic_dataset(num_samples: int, dim: int, seed: int = 1234):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_samples, dim, generator=generator)
    weights = torch.randn(dim, 1, generator=generator)
    targets = torch.tanh(inputs @ weights) + 0.01 * torch.randn(num_samples, 1, generator=generator)
    return inputs, targets


def build_model(dim: int) -> torch.nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank and every run
    return torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def average_gradients(model: torch.nn.Module, world_size: int) -> None:
    """Sum of per-rank gradient sums / global batch = the global-batch mean gradient."""
    for param in model.parameters():
        if world_size > 1:
            dist.all_reduce(param.grad)


def pause(step_time: float, fast_file: str | None) -> None:
    """The --step-time sleep, skipped once --fast-file exists (a test's idle tail)."""
    if step_time and not (fast_file and os.path.exists(fast_file)):
        time.sleep(step_time)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--policy", default="constant-global")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=0, help="stop after this global step (0: epochs)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-dir", default="runs/mlp-ckpt")
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra sleep per step")
    parser.add_argument("--trace", help="append one JSON line per step with the indices trained")
    parser.add_argument("--fast-file", help="once this file exists, steps skip "
                        "--step-time (a test ends the idle tail of its epoch)")
    args = parser.parse_args()

    with er.init() as ctx:
        inputs, targets = synthetic_dataset(args.samples, args.dim)
        model = build_model(args.dim)
        sampler = er.ElasticSampler(args.samples, global_batch_size=args.global_batch,
                                    policy=args.policy, seed=0)
        plan = sampler.batch_plan
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * plan.lr_factor)
        ckpt = er.Checkpointer(args.checkpoint_dir, keep=3, every=args.every)
        state = ckpt.load_latest()
        if state:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optim"])
            sampler.load_state_dict(state["sampler"])
            for group in optimizer.param_groups:
                group["lr"] = args.lr * plan.lr_factor
        if ctx.rank == 0:
            print(f"round {ctx.round}: world {ctx.world_size}, {plan.describe()}, resuming after "
                  f"step {sampler.step}", flush=True)
        trace = open(args.trace, "a", buffering=1) if args.trace else None
        for epoch in range(sampler.epoch, args.epochs):
            sampler.set_epoch(epoch)
            started = time.perf_counter()
            for step, indices in sampler:
                optimizer.zero_grad()
                batch = torch.tensor(indices, dtype=torch.long)
                loss_sum = torch.nn.functional.mse_loss(
                    model(inputs[batch]), targets[batch], reduction="sum") if indices else \
                    sum(p.sum() * 0 for p in model.parameters())
                (loss_sum / sampler.batch_plan.global_batch).backward()
                average_gradients(model, ctx.world_size)
                optimizer.step()
                if trace:
                    trace.write(json.dumps({"step": step, "rank": ctx.rank, "epoch": epoch,
                                            "world": ctx.world_size, "round": ctx.round,
                                            "indices": indices,
                                            "loss": loss_sum.item() / max(len(indices), 1)}) + "\n")
                if ctx.rank == 0 and step % 10 == 0:
                    rate = len(indices) * ctx.world_size / (time.perf_counter() - started)
                    print(f"step {step} world {ctx.world_size} loss "
                          f"{loss_sum.item() / max(len(indices), 1):.4f} samples/s {rate:.0f}",
                          flush=True)
                started = time.perf_counter()
                pause(args.step_time, args.fast_file)
                if ckpt.due(step):
                    ckpt.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict(),
                                     "sampler": sampler.state_dict()})
                if args.steps and step >= args.steps:
                    break
            if args.steps and sampler.step >= args.steps:
                break
        ckpt.close()


if __name__ == "__main__":
    main()
