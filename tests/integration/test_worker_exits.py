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


# Forks a child that keeps the worker's pipes (as a DataLoader's workers do, which torch
# ends up to 5 s after their parent), writes its last lines, and is SIGKILLed.
DIES_BESIDE_A_CHILD = '''import os, signal, sys, time
child = os.fork()
if child == 0:
    time.sleep(120)
    os._exit(0)
with open(sys.argv[1], "w") as out:
    out.write(str(child))
for line in range(300):
    print(f"line {line}", file=sys.stderr)
sys.stderr.flush()
os.kill(os.getpid(), signal.SIGKILL)
'''


def test_a_dead_workers_last_lines_are_read_though_its_child_holds_the_pipes(
        tmp_path, monkeypatch):
    """The agent no longer waits for the pipes' end, which the child would hold for
    minutes: OUTPUT_WAIT_S is made an hour, so only the pipes' quiet ends the wait
    (before: each pipe's join waited out 1 s, and a worker SIGKILLed beside two
    loader processes was reported 2.1 s after its death). Its last line still
    arrives in the error tail."""
    from elastic_runner.agent import workers

    monkeypatch.setattr(workers, "OUTPUT_WAIT_S", 3600.0)
    script = tmp_path / "dies.py"
    script.write_text(DIES_BESIDE_A_CHILD)
    child_file = tmp_path / "child"
    config = WorkerConfig(argv=(*PYTHON_ENTRY, str(script), str(child_file)), nproc=1,
                          fingerprint="f")
    plan = Plan(round=0, members=(Member("a", 0, 1, "127.0.0.1", 0),),
                master_addr="127.0.0.1", master_port=29500)
    group = WorkerGroup.start(plan, "a", WorkerEnv(run_id="job"), config, dict(os.environ),
                              echo=False)
    try:
        deadline = time.monotonic() + 60
        while group.poll()[0] is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child = int(child_file.read_text())
        assert not ended(child)  # it still holds the pipes
        exit_ = group.poll()[0]
        assert exit_.exit_code == -9 and exit_.stderr_tail[-1] == "line 299"
    finally:
        if child_file.exists():
            os.kill(int(child_file.read_text()), 9)
