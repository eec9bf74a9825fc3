"""One training loop written four ways, for the resize matrix (issue 13):

- due:      ElasticSampler, `if ckpt.due(step): ckpt.save(step, {state dicts})`
- cadence:  ElasticSampler, its own cadence `if step % 10 == 9: ckpt.save(step, objects)`
            with `ckpt.restore(objects)` at start; never calls due()
- sampler:  ElasticSampler, no checkpointer at all
- plain:    no sampler, no checkpointer: a fixed number of all-reduce steps
Every rank appends one JSON line per step to --trace (step, round, world, indices).
A fault armed by the harness (Job.fail_worker) ends its rank as it reaches its step.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
from injected_fault import fail_if_armed
from pacing import pause

import elastic_runner as er


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--style", choices=("due", "cadence", "sampler", "plain"), required=True)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--samples", type=int, default=1600)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--every", type=int, default=1000, help="due(): a checkpoint every N steps")
    parser.add_argument("--fast-file", help="once this file exists, steps skip "
                        "--step-time (a test ends the idle tail of its epoch)")
    args = parser.parse_args()
    with er.init() as ctx, open(args.trace, "a", buffering=1) as trace:
        def log(step, indices):
            trace.write(json.dumps({"step": step, "rank": ctx.rank, "world": ctx.world_size,
                                    "round": ctx.round, "indices": indices,
                                    "t": time.time()}) + "\n")

        if args.style == "plain":
            for step in range(1, args.samples // args.global_batch + 1):
                fail_if_armed(ctx.rank, step)
                ones = torch.ones(1)
                dist.all_reduce(ones)
                log(step, [])
                pause(args.step_time, args.fast_file)
            return
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        sampler = er.ElasticSampler(args.samples, global_batch_size=args.global_batch, seed=1)
        ckpt = None
        if args.style == "due":
            ckpt = er.Checkpointer(args.checkpoint_dir, every=args.every)
            state = ckpt.load_latest()
            if state:
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optim"])
                sampler.load_state_dict(state["sampler"])
        elif args.style == "cadence":
            ckpt = er.Checkpointer(args.checkpoint_dir)
            ckpt.restore({"model": model, "optim": optimizer, "sampler": sampler})
        for step, indices in sampler:
            fail_if_armed(ctx.rank, step)
            optimizer.zero_grad()
            loss = model(torch.ones(max(len(indices), 1), 4)).sum()
            loss.backward()
            for param in model.parameters():
                dist.all_reduce(param.grad)
            optimizer.step()
            log(step, indices)
            pause(args.step_time, args.fast_file)
            if args.style == "due" and ckpt.due(step):
                ckpt.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict(),
                                 "sampler": sampler.state_dict()})
            if args.style == "cadence" and step % 10 == 9:
                ckpt.save(step, {"model": model, "optim": optimizer, "sampler": sampler})


if __name__ == "__main__":
    main()
