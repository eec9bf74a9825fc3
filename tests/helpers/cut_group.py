"""One rank of a gloo group whose member 2 freezes: ranks 0 and 1 block in an
all-reduce (collective timeout 120 s) until their channel says the round is broken.

    python -m tests.helpers.cut_group RANK STORE_FILE CHANNEL_DIR [subgroup]

`subgroup`: the blocked all-reduce is on a group made as a training function makes
one (dist.new_group, torch's default timeout: 30 minutes for gloo), under
capturing_new_groups as er.elastic runs the function.

Prints "blocked" once in the collective, then "failed <seconds> <first line>" when
it fails, and exits 0; rank 2 stops itself (SIGSTOP) after the first all-reduce.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_runner.reform import ReformChannel
from elastic_runner.worker.abort import capturing_new_groups, group_sockets, leave_process_group
from elastic_runner.worker.broken_round import BrokenRoundWatch
from elastic_runner.worker.elastic import collective_failure

WORLD = 3


def main() -> int:
    rank, store_file, channel_dir = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    with group_sockets.capture():
        dist.init_process_group("gloo", store=dist.FileStore(store_file, WORLD), rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    group = None
    if sys.argv[4:] == ["subgroup"]:
        with capturing_new_groups():
            group = dist.new_group(list(range(WORLD)))
    tensor = torch.ones(8)
    dist.all_reduce(tensor, group=group)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
        return 0
    with BrokenRoundWatch(ReformChannel(channel_dir), lambda: 0, group_sockets, poll_s=0.05):
        print("blocked", flush=True)
        started = time.monotonic()
        try:
            dist.all_reduce(tensor, group=group)
        except RuntimeError as error:
            print(f"failed {time.monotonic() - started:.2f} {collective_failure(error)}",
                  flush=True)
            # As elastic.py does after a failed collective: a cut group left alive
            # until the interpreter's exit ended it with SIGABRT now and then
            # ("terminate called without an active exception", 1 in ~40 under load).
            leave_process_group(logging.getLogger(__name__))
            return 0
    print("completed", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
