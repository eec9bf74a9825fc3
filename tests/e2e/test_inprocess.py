"""Workers that survive a resize in their own process (issue 15), end to end.

Real agents, real etcd, real gloo workers running examples/train_inproc.py
(`er.State` + `@er.elastic`). Each rank logs one line per step with its pid, round,
world size, the sample indices it trained and a checksum of the parameters after the
step. The assertions are the issue's: surviving workers keep their PIDs, every rank
agrees on the checksum at every step of a round, every sample of the epoch is trained
exactly once (counting each step in the last round that completed it), and at most the
step in flight is re-done on a loss, none on a notice or a join.
"""

from __future__ import annotations

import collections
import signal
from pathlib import Path

import pytest

from elastic_runner._process import process_tree, stat_fields
from elastic_runner.etcd.server import free_port
from tests.e2e.harness import Job, read_jsonl

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_inproc.py"
# 300 steps: the epoch must outlast every change of a test, and a newcomer's standby
# start (import torch, the model) runs while the others train: 60 steps when quiet,
# up to 130 with two CPU hogs alongside. The steps after the last change run without
# their sleep (finished(): Job.hurry).
SAMPLES = 7200
BATCH = 24  # divisible by 1, 2, 3 and 4 ranks: every rank trains the same count per step
LAST_STEP = SAMPLES // BATCH  # the sampler counts steps from 1
# A frozen node stops the others' training until they re-form: 150 steps are enough
# to freeze one mid-epoch.
FROZEN_SAMPLES = 3600


@pytest.fixture
def inproc(etcd, tmp_path):
    job = Job(etcd.endpoint, tmp_path, script=SCRIPT, nproc=1, lease_ttl=3, settle=0.5)
    job.trace = tmp_path / "trace.jsonl"
    job.script_args = ("--samples", str(SAMPLES), "--global-batch", str(BATCH),
                       "--step-time", "0.05", "--trace", str(job.trace),
                       "--checkpoint-dir", str(tmp_path / "ckpt"), "--every", "1000",
                       "--fast-file", str(job.fast_file))
    yield job
    job.stop_all()


def rows(job: Job) -> list[dict]:
    """The steps logged so far (a line cut by a SIGKILL mid-write is skipped); each
    carries the rank's "began" lines of its round as `began_by_step`, for
    check_exactly_once."""
    trace = read_jsonl(job.trace)
    began = collections.defaultdict(list)
    for row in trace:
        if "began" in row:
            began[(row["began"], row["round"])].append(row["indices"])
    steps = [row for row in trace if "began" not in row and "booted" not in row]
    for row in steps:
        row["began_by_step"] = began.get((row["step"], row["round"]), [])
    return steps


def wait_world(job: Job, world: int, steps: int = 3, after_round: int = -1,
               new_pid: bool = False) -> int:
    """Wait until every rank of a round with `world` ranks logged `steps` steps; its round.

    `new_pid`: only a round with a process that no earlier round had (a newcomer)."""
    def reached():
        trace = rows(job)
        by_round = collections.defaultdict(collections.Counter)
        pids_by_round = collections.defaultdict(set)
        for row in trace:
            pids_by_round[row["round"]].add(row["pid"])
            if row["world"] == world and row["round"] > after_round:
                by_round[row["round"]][row["rank"]] += 1
        done = [r for r, counts in by_round.items()
                if len(counts) == world and min(counts.values()) >= steps and (
                    not new_pid or pids_by_round[r] - set().union(
                        *(p for q, p in pids_by_round.items() if q < r)))]
        return [min(done)] if done else None  # a list: round 0 is a result too
    return job.wait_for(reached, 120, f"{steps} steps at world size {world}")[0]


def finished(job: Job, *nodes: str) -> dict[str, int]:
    """The exit codes, once the epoch's rest (after the test's last change) has run."""
    job.hurry()
    return {node: job.wait_exit(node, timeout=180) for node in nodes}


def check_consistency(trace: list[dict]) -> None:
    """Every rank of a round logged the same checksum at each step."""
    by_step = collections.defaultdict(set)
    for row in trace:
        by_step[(row["round"], row["step"])].add(round(row["checksum"], 6))
    assert [key for key, sums in by_step.items() if len(sums) > 1] == []


def check_exactly_once(trace: list[dict], samples: int = SAMPLES) -> collections.Counter:
    """Each step counts in the last round that completed it, with the indices every
    rank began it with there (a rank that contributed to the step's all-reduces and
    then lost its peer never logs it, but the ranks that completed it applied its
    gradients); return steps re-done."""
    last = {}
    for row in trace:
        if row["round"] >= last.get(row["step"], row)["round"]:
            last[row["step"]] = row
    trained = collections.Counter()
    for row in last.values():
        for indices in row["began_by_step"]:
            trained.update(indices)
    assert sorted(trained) == list(range(samples))
    assert set(trained.values()) == {1}
    rounds_per_step = collections.Counter()
    for step, rounds in _rounds_by_step(trace).items():
        rounds_per_step[step] = len(rounds)
    return collections.Counter({s: n - 1 for s, n in rounds_per_step.items() if n > 1})


def check_each_sample_once_in_its_last_round(trace: list[dict], samples: int) -> None:
    """For helpers/inproc_worker.py's step rows: each step counts in the last round
    that logged it."""
    newest = collections.defaultdict(int)
    for row in trace:
        newest[row["step"]] = max(newest[row["step"]], row["round"])
    trained = collections.Counter(i for row in trace if row["round"] == newest[row["step"]]
                                  for i in row["indices"])
    assert sorted(trained) == list(range(samples)) and set(trained.values()) == {1}


def _rounds_by_step(trace: list[dict]) -> dict[int, set[int]]:
    found = collections.defaultdict(set)
    for row in trace:
        found[row["step"]].add(row["round"])
    return found


def pids(trace: list[dict]) -> set[int]:
    return {row["pid"] for row in trace}


def test_leave_join_and_sigkill_of_the_rank0_host_in_one_run(inproc):
    """Three changes, one job (one job start instead of three: the suite's time).

    A node leaves with notice (no step re-done), a node joins and receives the state
    (no step re-done), then the node hosting rank 0 is SIGKILLed (at most the step in
    flight re-done). No surviving worker is ever restarted: four nodes, four processes."""
    inproc.start("a", "b", "c", notice_deadline=20)
    first = wait_world(inproc, 3)
    inproc.terminate("c")
    left = wait_world(inproc, 2, after_round=first)
    assert inproc.wait_exit("c", timeout=60) == 0
    assert "left the run with notice; the workers followed" in inproc.agent_log("c")
    redone_after_leave = check_consistency_and_redone(rows(inproc))
    inproc.start("d")
    joined = wait_world(inproc, 3, after_round=left, new_pid=True)
    redone_after_join = check_consistency_and_redone(rows(inproc))
    # d's worker was started on standby, before d joined: its process trains in the round.
    assert "standby workers ready" in inproc.agent_log("d")
    assert "starting fresh workers" not in inproc.agent_log("d")
    host = next(r for r in rows(inproc) if r["round"] == joined and r["rank"] == 0)["pid"]
    node = next(n for n in ("a", "b", "d") if inproc.agents[n].pid == _parent(host))
    inproc.kill(node)
    wait_world(inproc, 2, after_round=joined)
    survivors = [n for n in ("a", "b", "d") if n != node]
    assert finished(inproc, *survivors) == {n: 0 for n in survivors}
    trace = rows(inproc)
    check_consistency(trace)
    redone = check_exactly_once(trace)
    assert (redone_after_leave, redone_after_join) == (0, 0)
    assert sum(redone.values()) <= 1, redone
    assert len(pids(trace)) == 4
    assert max(r["step"] for r in trace) == LAST_STEP


def test_a_frozen_node_does_not_hang_the_survivors(inproc):
    """The whole node freezes, its worker too (SIGSTOP: sockets open, no answer).
    Once its lease expires the agents mark the round broken, the survivors cut their
    group's connections (worker/broken_round.py) instead of waiting out the collective
    timeout (12 s here), and re-form in their own processes. Before the step
    boundary's group got the job's timeout, leaving the group waited on its agreement
    in flight (30 minutes, torch's default) and the agents fell back to restarting
    the survivors."""
    inproc.script_args = _with_samples(inproc.script_args, samples=FROZEN_SAMPLES)
    inproc.start("a", "b", "c")
    first = wait_world(inproc, 3)
    inproc.kill("c", signal.SIGSTOP)
    try:
        node = process_tree(inproc.agents["c"].pid)
        assert len(node) >= 2  # the agent and its worker
        # A signal takes effect when its process is next scheduled: on a busy machine
        # a running one shows R for a moment.
        inproc.wait_for(lambda: {_state(pid) for pid in node} == {"T"}, 10,
                        "the whole node to stop")
        wait_world(inproc, 2, after_round=first)
    finally:
        inproc.kill("c", signal.SIGKILL)
    assert finished(inproc, "a", "b") == {"a": 0, "b": 0}
    trace = rows(inproc)
    check_consistency(trace)
    assert sum(check_exactly_once(trace, samples=FROZEN_SAMPLES).values()) <= 1
    assert len(pids(trace)) == 3  # the survivors' workers were never restarted
    assert all("re-formed in place" in inproc.agent_log(n) for n in ("a", "b"))
    assert not any("Timed out" in inproc.agent_log(n) for n in ("a", "b"))  # cut, not timed out


def test_two_changes_in_quick_succession(inproc):
    inproc.start("a", "b", "c", notice_deadline=20)
    first = wait_world(inproc, 3)
    inproc.terminate("c")
    inproc.start("d")
    wait_world(inproc, 3, after_round=first, new_pid=True)  # one round or two: both fine
    assert finished(inproc, "a", "b", "c", "d") == {"a": 0, "b": 0, "c": 0, "d": 0}
    trace = rows(inproc)
    check_consistency(trace)
    assert check_exactly_once(trace) == {}
    assert len(pids(trace)) == 4


def test_a_loss_while_the_workers_start_restarts_nobody(inproc):
    """er.init(defer_group=True): the first group forms when train() is first called.

    While the workers "build their model" (--boot-delay), c is SIGKILLed: a and b
    follow its loss into the next round without restarting their workers
    (agent/deferred.py), and take their places in it once ready. (A newcomer followed
    the same way, and one that starts on standby once the run is marked by the
    workers' first report, are in tests/unit/test_agent_deferred.py and the join tests
    above; bench/start_join.py measures a join while a job starts.)"""
    inproc.script_args = (*_with_samples(inproc.script_args, samples=FROZEN_SAMPLES),
                          "--defer-group", "--boot-delay", "8")
    inproc.start("a", "b", "c")
    inproc.wait_for(lambda: len(_booted(inproc)) == 3, 60, "three workers to boot")
    inproc.kill("c")
    wait_world(inproc, 2)
    assert finished(inproc, "a", "b") == {"a": 0, "b": 0}
    trace = rows(inproc)
    check_consistency(trace)
    assert check_exactly_once(trace, samples=FROZEN_SAMPLES) == {}  # no step before c's loss
    assert {row["world"] for row in trace} == {2}
    assert len(pids(trace)) == 2  # a's and b's first workers: nobody restarted
    assert pids(trace) <= {row["booted"] for row in _booted(inproc)}
    for node in ("a", "b"):
        log = inproc.agent_log(node)
        assert "while the workers get ready (member-lost: c" in log, log[-3000:]
        assert "stopping workers" not in log


def _booted(job: Job) -> list[dict]:
    return [row for row in read_jsonl(job.trace) if "booted" in row]


def check_consistency_and_redone(trace: list[dict]) -> int:
    """So far: checksums agree, and how many steps some round has re-done."""
    check_consistency(trace)
    return sum(len(rounds) - 1 for rounds in _rounds_by_step(trace).values())


def _with_samples(script_args: tuple[str, ...], samples: int) -> tuple[str, ...]:
    args = list(script_args)
    args[args.index("--samples") + 1] = str(samples)
    return tuple(args)


def _parent(pid: int) -> int:
    """A worker's agent: its parent process."""
    return int(stat_fields(pid)[1])


def _state(pid: int) -> str:
    """A process's state letter: T when stopped."""
    return stat_fields(pid)[0].decode()


@pytest.mark.parametrize("loading", [(), ("--loader-workers", "2")],
                         ids=["sampler", "loader-workers"])
def test_ddp_built_before_train_resizes_by_restarting(etcd, tmp_path, loading):
    """A script that wraps its model in DDP before its @er.elastic function. Before: a
    node joining two made the survivors' backward time out on the destroyed group, the
    job re-formed in place again and again and ended with exit 6. Now every worker keeps
    the restart path (one warning line each), and the join is an ordinary restart.

    With a checkpoint folder, the restarted workers resume from the step the join
    stopped at (its boundary checkpoint), so a position saved ahead of training (a
    loader's prefetched batches) would leave samples untrained."""
    worker = Path(__file__).resolve().parents[1] / "helpers" / "inproc_worker.py"
    traces = tmp_path / "traces"
    traces.mkdir()
    job = Job(etcd.endpoint, tmp_path, script=worker, nproc=1, lease_ttl=3, settle=0.5,
              script_args=("--trace-dir", str(traces), "--samples", "2400", "--batch", "12",
                           "--ddp-before-train", "--ckpt", str(tmp_path / "ckpt"),
                           "--every", "1000", *loading, "--hold-at", "6",
                           "--release", str(tmp_path / "release")))
    try:
        job.start("a", "b")  # held at step 6 until c is ready to join: before, a loaded
        # machine finished the epoch at world 2 first (1 run in 3 with two CPU hogs)

        def steps():
            return [row for path in traces.glob("*.jsonl") for row in read_jsonl(path)
                    if row["kind"] == "step"]
        job.wait_for(lambda: sum(row["kind"] == "held" for path in traces.glob("*.jsonl")
                                 for row in read_jsonl(path)) == 2, 90, "world 2 held")
        job.start("c")
        job.wait_for(lambda: "membership changed: newcomer" in job.agent_log("a"), 90,
                     "c registered")
        (tmp_path / "release").touch()
        job.wait_for(lambda: sum(r["world"] == 3 for r in steps()) >= 6, 90, "world 3")
        assert finished(job, "a", "b", "c") == {"a": 0, "b": 0, "c": 0}
        trace = steps()
        pids = {world: {r["pid"] for r in trace if r["world"] == world} for world in (2, 3)}
        assert len(pids[3]) == 3 and not pids[2] & pids[3]  # restarted, not kept
        check_each_sample_once_in_its_last_round(trace, 2400)
        resumed_at = min(r["step"] for r in trace if r["world"] == 3)
        assert resumed_at == max(r["step"] for r in trace if r["world"] == 2) + 1 > 6
        for node in "abc":
            assert "the script made 1 DistributedDataParallel wrapper(s) before the " \
                   "training function" in job.agent_log(node)
            assert "re-formed in place" not in job.agent_log(node)
    finally:
        job.stop_all()


def test_a_loop_sampler_left_out_of_the_state_is_named_at_the_first_re_formation(
        etcd, tmp_path):
    """er.State(model=..., optimizer=...) while the loop runs an ElasticSampler: the
    State cannot keep or send its position, so a newcomer starts at the beginning of
    the epoch. Before, nothing said so; now each survivor's first re-formation does,
    once. (Only the line is asserted: the ranks' loops disagree after it.)"""
    worker = Path(__file__).resolve().parents[1] / "helpers" / "inproc_worker.py"
    traces = tmp_path / "traces"
    traces.mkdir()
    job = Job(etcd.endpoint, tmp_path, script=worker, nproc=1, lease_ttl=3, settle=0.5,
              script_args=("--trace-dir", str(traces), "--samples", "2400", "--batch", "12",
                           "--sampler-outside-state", "--hold-at", "6",
                           "--release", str(tmp_path / "release")))
    warning = "the ElasticSampler of the training loop is not the one in er.State"
    try:
        job.start("a", "b")  # held at step 6 until c is ready to join
        job.wait_for(lambda: sum(row["kind"] == "held" for path in traces.glob("*.jsonl")
                                 for row in read_jsonl(path)) == 2, 90, "world 2 held")
        job.start("c")
        job.wait_for(lambda: "joining the run" in job.agent_log("c"), 90, "c ready")
        assert warning not in job.agent_log("a") + job.agent_log("b")
        (tmp_path / "release").touch()
        job.wait_for(lambda: all(warning in job.agent_log(node) for node in "ab"), 90,
                     "the survivors' warning")
        assert all(job.agent_log(node).count(warning) == 1 for node in "ab")
    finally:
        job.stop_all()


@pytest.mark.parametrize("loading, fixed_port", [
    (("--loader-workers", "-1"), True),
    (("--loader-workers", "2"), False),
    (("--loader-workers", "2", "--persistent-loader"), True),
], ids=["sampler-fixed-master-port", "loader-workers", "persistent-loader-fixed-master-port"])
def test_a_join_in_place_trains_every_sample_once_however_batches_are_loaded(
        etcd, tmp_path, loading, fixed_port):
    """Survivors pause at the boundary after the step they trained, keep their
    processes, and the newcomer receives the position of that step; every sample of the
    epoch is trained exactly once across the join.

    - er.ElasticDataLoader with two worker processes per rank: the boundary is not a
      step its workers loaded ahead (a torch DataLoader over the sampler skipped 48
      samples here, 4 steps of 12).
    - A fixed --master-port: rank 0 reopens the round's store on the last one's port
      (before: the new group read the last round's gloo addresses, and re-formed
      without end: 900 rounds in 90 s).
    - Both, with the loader's workers persistent: they were forked while the store
      listened and must not keep its port."""
    worker = Path(__file__).resolve().parents[1] / "helpers" / "inproc_worker.py"
    traces = tmp_path / "traces"
    traces.mkdir()
    job = Job(etcd.endpoint, tmp_path, script=worker, nproc=1, lease_ttl=3, settle=0.5,
              script_args=("--trace-dir", str(traces), "--samples", "2400", "--batch", "12",
                           *loading, "--hold-at", "6", "--release", str(tmp_path / "release")))
    ports = {"master_port": free_port()} if fixed_port else {}

    def steps():
        return [row for path in traces.glob("*.jsonl") for row in read_jsonl(path)
                if row["kind"] == "step"]
    try:
        job.start("a", "b", **ports)  # held at step 6 until c is ready to join
        job.wait_for(lambda: sum(row["kind"] == "held" for path in traces.glob("*.jsonl")
                                 for row in read_jsonl(path)) == 2, 90, "world 2 held")
        job.start("c", **ports)
        job.wait_for(lambda: "joining the run" in job.agent_log("c"), 90, "c ready")
        (tmp_path / "release").touch()
        job.wait_for(lambda: sum(r["world"] == 3 for r in steps()) >= 6, 90, "world 3")
        assert finished(job, "a", "b", "c") == {"a": 0, "b": 0, "c": 0}
        trace = steps()
        by_world = {world: {r["pid"] for r in trace if r["world"] == world} for world in (2, 3)}
        assert len(by_world[2]) == 2 and by_world[2] < by_world[3]  # kept: re-formed in place
        check_each_sample_once_in_its_last_round(trace, 2400)
        first_at_3 = min(r["step"] for r in trace if r["world"] == 3)
        assert first_at_3 > 6 and max(r["step"] for r in trace if r["world"] == 2) < first_at_3
        for node in "ab":
            assert "re-formed in place" in job.agent_log(node)
    finally:
        job.stop_all()
