"""A gloo worker whose rank 1 stops taking part in collectives at step 10 of the
first run (a deadlock as seen by rank 0), reporting progress with er.report()."""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import elastic_runner as er


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with er.init() as ctx:
        with open(args.out, "a", buffering=1) as out:
            for step in range(args.steps):
                if step == 10 and ctx.rank == 1 and ctx.restart_count == 0:
                    time.sleep(3600)  # never reaches the all-reduce rank 0 waits in
                total = torch.ones(1)
                dist.all_reduce(total)
                er.report(step, step)
                out.write(json.dumps({"step": step, "rank": ctx.rank, "pid": os.getpid(),
                                      "restart": ctx.restart_count}) + "\n")
                time.sleep(0.05)


if __name__ == "__main__":
    main()
