"""Which worker the agent names when several fail: the one that ended first.

Real processes, no etcd (the plan is given). One worker's death breaks its peers'
collectives and they exit too, often within milliseconds; the agent looks a few times
a second and finds them all gone at once. Its error line must name the cause."""

from __future__ import annotations

import os
import time

from elastic_runner._process import stat_fields
from elastic_runner.agent.workers import WorkerGroup
from elastic_runner.config import WorkerConfig
from elastic_runner.contract import PYTHON_ENTRY, WorkerEnv
from elastic_runner.rendezvous.protocol import Member, Plan

# Local rank 1 fails at once; local rank 0 fails 0.3 s later, as a peer whose
# collective broke would.
FAILS_IN_ORDER = '''import os, sys, time
if os.environ["LOCAL_RANK"] == "0":
    time.sleep(0.3)
sys.exit(int(os.environ["LOCAL_RANK"]) + 3)
'''


def test_the_worker_that_ended_first_is_named_though_both_were_found_gone_at_one_look(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAILS_IN_ORDER)
    config = WorkerConfig(argv=(*PYTHON_ENTRY, str(script)), nproc=2, fingerprint="f")
    plan = Plan(round=0, members=(Member("a", 0, 2, "127.0.0.1", 0),),
                master_addr="127.0.0.1", master_port=29500)
    group = WorkerGroup.start(plan, "a", WorkerEnv(run_id="job"), config, dict(os.environ),
                              echo=False)
    deadline = time.monotonic() + 60
    while not all(map(ended, group.pids)) and time.monotonic() < deadline:
        time.sleep(0.05)  # watched from /proc: the agent's first look comes after both ended
    assert all(map(ended, group.pids))
    first = group.first_failure()
    assert (first.local_rank, first.exit_code) == (1, 4)
    exits = sorted(group.poll(), key=lambda e: e.at)
    assert [e.local_rank for e in exits] == [1, 0]
    assert 0.2 < exits[1].at - exits[0].at < 5.0  # stamped when each ended, not when seen


def ended(pid: int) -> bool:
    """Exited: reaped already, or a zombie waiting to be."""
    fields = stat_fields(pid)
    return fields is None or fields[0] == b"Z"
