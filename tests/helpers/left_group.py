"""One rank of a two-rank gloo group (collective timeout 120 s) in which rank 1 leaves
the round as after a failed collective, while something still holds the group (as a
DDP's reducer does), and rank 0 then calls an all-reduce.

    python -m tests.helpers.left_group RANK STORE_FILE LEFT_MARKER cut|no-cut

Rank 1 prints "left" once out of the group (cut: leave_process_group's `cut`), then
sleeps until it is killed. Rank 0 waits for LEFT_MARKER, then prints
"failed <seconds> <first line>" when its all-reduce fails, and exits 0.
"""

from __future__ import annotations

import datetime
import logging
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_runner.worker.abort import group_sockets, leave_process_group

HELD = []  # what keeps the left group, and its sockets, alive


def main() -> int:
    rank, store_file, marker, mode = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    with group_sockets.capture():
        dist.init_process_group("gloo", store=dist.FileStore(store_file, 2), rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=120))
    dist.all_reduce(torch.ones(1))  # every connection is up
    if rank == 1:
        HELD.append(dist.group.WORLD)
        leave_process_group(logging.getLogger("left_group"), cut=mode == "cut")
        marker.touch()
        print("left", flush=True)
        time.sleep(600)
        return 0
    while not marker.exists():
        time.sleep(0.01)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as error:
        print(f"failed {time.monotonic() - start:.2f} {str(error).splitlines()[0]}", flush=True)
        # As a worker does after a failed collective. Left alive to the interpreter's
        # teardown, the broken group's gloo threads sometimes ended the process with
        # "terminate called without an active exception" (SIGABRT), 1 run in ~30.
        leave_process_group(logging.getLogger("left_group"))
        return 0
    print("all-reduce returned", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
