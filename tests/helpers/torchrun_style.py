"""A training script written for torchrun, untouched: no elastic_runner import.

It builds its process group from the environment, decorates main with torch's
@record, and checkpoints itself (rank 0, torch.save, atomic rename) every
--every steps, resuming from that file when it exists. Each rank appends one
JSON line per step to --out.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--step-time", type=float, default=0.05)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    start, total = 0, torch.zeros(1)
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, weights_only=True)
        start, total = state["step"] + 1, state["total"]
    with open(args.out, "a", buffering=1) as out:
        for step in range(start, args.steps):
            ones = torch.ones(1)
            dist.all_reduce(ones)
            total += 1
            out.write(json.dumps({"step": step, "t": time.time(), "RANK": str(rank),
                                  "WORLD_SIZE": str(world), "resumed_from": start,
                                  "ELASTIC_RUN_ROUND": os.environ.get("ELASTIC_RUN_ROUND", ""),
                                  "total": int(total.item())}) + "\n")
            if rank == 0 and step % args.every == args.every - 1:
                temporary = args.ckpt + ".tmp"
                torch.save({"step": step, "total": total}, temporary)
                os.replace(temporary, args.ckpt)
            time.sleep(args.step_time)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
