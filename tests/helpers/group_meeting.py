"""One rank of three making a gloo group under capturing_new_groups, as er.elastic
runs the training function (each member meets the others in the store first).

    python -m tests.helpers.group_meeting RANK STORE_FILE CHANNEL_DIR MODE

MODE `lost`: rank 2 leaves after the default group formed; ranks 0 and 1 then make
a group of all three (timeout 120 s), print "making", and print "failed <seconds>
<first line>" once it fails (their channel says the round is broken).
MODE `pair`: a group of ranks 0 and 1, rank 2 not a member (torch has every rank
call new_group); the members all-reduce a one on it and print "sum <value>".
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_runner.reform import ReformChannel
from elastic_runner.worker import formation
from elastic_runner.worker.abort import capturing_new_groups
from elastic_runner.worker.elastic import collective_failure

WORLD = 3
TIMEOUT = datetime.timedelta(seconds=120)


def main() -> int:
    rank, store_file, channel_dir, mode = (int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]),
                                           sys.argv[4])
    dist.init_process_group("gloo", store=dist.FileStore(store_file, WORLD), rank=rank,
                            world_size=WORLD, timeout=TIMEOUT)
    channel = ReformChannel(channel_dir)

    def meet(store, name: str, members: int, timeout_s: float) -> None:
        print(f"meeting {name} {members} {timeout_s:g}", flush=True)
        formation.meet_members(store, name, members, timeout_s,
                               called_off=lambda: channel.broken(0))

    dist.all_reduce(torch.ones(1))
    if mode == "lost" and rank == 2:
        os._exit(0)  # a member lost between two group creations
    members = [0, 1, 2] if mode == "lost" else [0, 1]
    print("making", flush=True)
    started = time.monotonic()
    try:
        with capturing_new_groups(meet):
            group = dist.new_group(members, timeout=TIMEOUT)
    except RuntimeError as error:
        print(f"failed {time.monotonic() - started:.2f} {collective_failure(error)}", flush=True)
        os._exit(0)  # the default group still lists rank 2: no orderly teardown
    if rank in members:
        total = torch.ones(1)
        dist.all_reduce(total, group=group)
        print(f"sum {total.item():g}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
