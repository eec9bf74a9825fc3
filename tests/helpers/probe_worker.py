"""A worker for end-to-end tests: logs what the launcher gave it, step by step.

Each step all-reduces a counter so a step only completes when the whole world is
present; every rank appends one JSON line per step to --out. A fault armed by the
harness (Job.fail_worker) ends its rank as it reaches its step. The all-reduce is
gloo's (`--collective gloo`, the default) or, for tests about the agents' decisions
rather than torch, the same meeting over plain TCP without importing torch
(`--collective socket`, helpers/socket_world.py).
"""

import sys

TORCH_PRELOADED = "torch" in sys.modules  # started by --prewarm (worker/prewarm.py)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

from injected_fault import fail_if_armed
from pacing import pause
from socket_world import SocketWorld

TIMEOUT_S = 30.0


class GlooWorld:
    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))

    def all_reduce_ones(self) -> int:
        import torch

        total = torch.ones(1)
        self.dist.all_reduce(total)
        return int(total.item())

    def close(self) -> None:
        self.dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--step-time", type=float, default=0.1)
    parser.add_argument("--fast-file", help="once this file exists, steps skip --step-time "
                        "(a test ends the idle tail of a run with --steps)")
    parser.add_argument("--fail-at-step", type=int, default=-1)
    parser.add_argument("--fail-rank", type=int, default=0)
    parser.add_argument("--collective", choices=("gloo", "socket"), default="gloo")
    parser.add_argument("--fail-only-first", action="store_true",
                        help="inject the failure only while TORCHELASTIC_RESTART_COUNT is 0")
    args = parser.parse_args()

    env = {k: os.environ.get(k, "") for k in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
        "ELASTIC_RUN_ROUND")}
    rank = int(env["RANK"])
    world = GlooWorld() if args.collective == "gloo" else SocketWorld(
        rank, int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]), TIMEOUT_S)
    with open(args.out, "a", buffering=1) as out:
        for step in range(args.steps):
            fail_if_armed(rank, step)
            first_run = env["TORCHELASTIC_RESTART_COUNT"] == "0"
            if step == args.fail_at_step and rank == args.fail_rank and (
                    first_run or not args.fail_only_first):
                raise SystemExit(f"injected failure at step {step} on rank {rank}")
            reduced = world.all_reduce_ones()
            out.write(json.dumps({"step": step, "t": time.time(), "pid": os.getpid(),
                                  "reduced": reduced, "preloaded": TORCH_PRELOADED,
                                  **env}) + "\n")
            pause(args.step_time, args.fast_file)
    world.close()


if __name__ == "__main__":
    main()
