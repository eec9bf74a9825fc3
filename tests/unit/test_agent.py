"""The agent's decisions with no etcd and no processes.

A fake rendezvous and fake workers (both satisfy agent/ports.py) stand in for etcd
and the worker processes, so each test scripts one situation exactly: which spot
notice wins, that a draining node leaves only after its workers stopped, and which
exit code each way of ending gives. Exit codes are read from errors.py's one map,
as the CLI does (`exit_code_for`).
"""

from __future__ import annotations

import itertools
import json
import signal
import threading
import time
from pathlib import Path

import pytest

from elastic_runner.agent.agent import Agent
from elastic_runner.agent.workers import WorkerExit
from tests.helpers.fake_workers import ExitQueries, run_as_the_cli
from elastic_runner.config import AgentConfig, EtcdConfig, RendezvousConfig, WorkerConfig
from elastic_runner.contract import EXIT_FOR_RESIZE
from elastic_runner.errors import (
    EXIT_CODES, EtcdUnavailable, ShutdownRequested, WorkerFailure,
)
from elastic_runner.rendezvous.failures import failure_message
from elastic_runner.rendezvous.protocol import Cause, CauseKind, Member, Plan
from elastic_runner.rendezvous.ranks import assign_ranks

NODE = "a"
LEASE_TTL_S = 2  # the agent's etcd grace is twice this
MAX_LOOKS = 500  # a monitor that looks this often without acting is a bug, not a wait


class FakeRendezvous:
    """Rounds of a one-node job that close at once; a worker failure restarts the
    round until --max-restarts is spent, as the real closer decides (engine.py).

    `on_look` runs at each of the monitor's waits, `on_ping` at each ping: the test's
    script of what happens while workers run or etcd is away.
    """

    def __init__(self, journal: list[str], max_restarts: int):
        self.journal = journal
        self.max_restarts = max_restarts
        self.events: list[dict] = []
        self.failures: list[dict] = []
        self.leaving: list[str] = []
        self.silent_s = 0.0
        self.etcd_answers = True
        self.on_look = lambda: None
        self.on_ping = lambda: None
        self.interrupted = False
        self.origin_answer: str | Exception = "0123456789abcdef"
        self._looks = itertools.count(1)

    def register(self, unless_in_place: bool = False) -> bool:
        self.journal.append("register")  # these workers never re-form in place: no standby
        return True

    def leave(self) -> None:
        self.journal.append("leave")

    def ping(self, write: bool = False) -> None:
        self.journal.append("ping")
        answers = self.etcd_answers
        self.on_ping()  # what happens while this ping is out: seen by the next one
        if not answers:
            raise EtcdUnavailable("no etcd endpoint answered (fake)")

    def etcd_answers_now(self) -> bool:
        self.journal.append("asked")
        return self.etcd_answers

    def current_round(self):
        return None

    def next_plan(self, previous: Plan | None, cause: Cause) -> Plan:
        if self.interrupted:
            raise ShutdownRequested("shutdown requested during rendezvous")
        restarts = previous.restart_count if previous else 0
        if previous is not None and cause.kind is CauseKind.WORKER_FAILURE:
            restarts += 1
            if restarts > self.max_restarts:
                raise WorkerFailure(failure_message(self.failures[-1], self.max_restarts))
        number = previous.round + 1 if previous else 0
        self.journal.append(f"round {number}")
        return Plan(number, (Member(NODE, 0, 2, "127.0.0.1", 0),), "127.0.0.1", 29500,
                    restart_count=restarts, cause=cause.text())

    def change_reason(self, plan: Plan) -> Cause | None:
        return None

    def report_failure(self, number: int, failure: dict) -> None:
        self.failures.append(failure)

    def publish_event(self, record: dict) -> None:
        self.events.append(record)

    def give_notice(self, round_number: int) -> None:
        self.journal.append(f"give_notice {round_number}")

    def notices(self, plan: Plan) -> list[str]:
        return list(self.leaving)

    def finish(self, plan: Plan) -> None:
        self.journal.append("finish")

    def change_marker(self) -> int:
        return 0

    def wait_for_change(self, timeout_s: float, since: int) -> bool:
        if next(self._looks) > MAX_LOOKS:
            raise AssertionError(f"the agent looked {MAX_LOOKS} times without acting")
        self.on_look()
        return False

    def wake(self) -> None:
        pass

    def interrupt(self) -> None:
        self.interrupted = True

    def seconds_since_etcd_answered(self) -> float:
        return self.silent_s

    def mark_in_place(self, round_number: int) -> None:
        self.journal.append(f"in place {round_number}")

    def origin(self) -> str:
        self.journal.append("origin")
        if isinstance(self.origin_answer, Exception):
            raise self.origin_answer
        return self.origin_answer

    def kinds(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind]


class FakeWorkers(ExitQueries):
    """One round's workers. They exit with `exits` (rank -> code) as soon as they
    start; the others run until signalled or stopped. With `boundary` they write
    progress records that promise a step boundary and, once the agent drops the
    notice file, finish `steps_to_boundary` more looks and exit EXIT_FOR_RESIZE."""

    def __init__(self, plan: Plan, job, journal: list[str], exits: dict[int, int],
                 boundary: bool, steps_to_boundary: int):
        self._ranks = assign_ranks(plan, NODE)
        self._codes: dict[int, int | None] = {r.rank: exits.get(r.rank) for r in self._ranks}
        self._journal = journal
        self._notice = Path(job.notice_path)
        self._steps_left = steps_to_boundary
        self._boundary = boundary
        self._clock = itertools.count()
        if boundary:
            self._report_progress(Path(job.progress_dir))

    def _report_progress(self, folder: Path) -> None:
        now = time.time()
        for ranks in self._ranks:
            record = {"step": 5, "time": now, "prev_step": 4, "prev_time": now - 0.05,
                      "boundary": True}
            (folder / f"rank{ranks.rank}.json").write_text(json.dumps(record))

    def _exit_running(self, code: int, why: str) -> None:
        running = [rank for rank, c in self._codes.items() if c is None]
        for rank in running:
            self._codes[rank] = code
        if running:
            self._journal.append(f"workers exited {code}: {why}")

    def _react(self) -> None:
        if self._boundary and self._notice.exists():
            if self._steps_left > 0:
                self._steps_left -= 1
            else:
                self._exit_running(EXIT_FOR_RESIZE, "checkpointed at a step boundary")

    @property
    def pids(self) -> list[int]:
        return [1000 + r.rank for r in self._ranks]

    def poll(self) -> list[WorkerExit | None]:
        self._react()
        return [None if self._codes[r.rank] is None else
                WorkerExit(r.rank, r.local_rank, self._codes[r.rank], next(self._clock), [], None)
                for r in self._ranks]

    def dump_stacks(self, local_ranks) -> None:  # never capable: no in-place fallback
        self._journal.append(f"stacks of {list(local_ranks)}")

    def signal_all(self, signum: int) -> None:
        self._journal.append(f"signal {signal.Signals(signum).name}")
        self._exit_running(-signum, "signalled")

    def wait(self, timeout_s: float) -> bool:
        return all(e is not None for e in self.poll())

    def stop(self, grace_s: float) -> None:
        self._journal.append("stop")
        self._exit_running(-signal.SIGTERM, "stopped")


class FakeWatcher:
    """The cloud's metadata service as the agent sees it: an event and a name."""

    source = "aws"

    def __init__(self):
        self.notice = threading.Event()

    def start(self) -> FakeWatcher:
        return self

    def stop(self) -> None:
        pass


class Node:
    """One agent wired to the fakes; `script` says how every round's workers behave."""

    def __init__(self, tmp_path: Path, max_restarts: int = 0, join_timeout_s: float = 600.0,
                 notice_deadline_s: float = 25.0, exits: dict[int, int] | None = None,
                 boundary: bool = True, steps_to_boundary: int = 0):
        self.journal: list[str] = []
        self.rendezvous = FakeRendezvous(self.journal, max_restarts)
        self.watcher = FakeWatcher()
        self.notice_file = tmp_path / "reclaim-notice"
        self.started: list[Plan] = []
        self.jobs: list = []  # the WorkerEnv each start was given
        self._script = (exits or {}, boundary, steps_to_boundary)
        rdzv = RendezvousConfig(run_id="unit", node_id=NODE, lease_ttl_s=LEASE_TTL_S,
                                join_timeout_s=join_timeout_s)
        workers = WorkerConfig(argv=("train.py",), nproc=2, fingerprint="f", stop_grace_s=0.0,
                               monitor_interval_s=0.0)
        config = AgentConfig(rdzv, EtcdConfig(), workers, max_restarts=max_restarts,
                             verbosity=0, notice_deadline_s=notice_deadline_s,
                             notice_file=self.notice_file)
        self.agent = Agent(config, self.rendezvous, EtcdConfig(), {}, self._start_workers,
                           self.watcher)

    def _start_workers(self, plan, node_id, job, config, base_env, echo=True, error_dir=None):
        self.started.append(plan)
        self.jobs.append(job)
        return FakeWorkers(plan, job, self.journal, *self._script)

    def run(self) -> int:
        code, self.error = run_as_the_cli(self.agent)
        return code


# ---- spot notices -----------------------------------------------------------------
SOURCES = ("sigterm", "file", "cloud", "etcd")


@pytest.mark.parametrize("given, reported", [
    (SOURCES, "SIGTERM"),
    (("file", "cloud", "etcd"), "file"),
    (("cloud", "etcd"), "aws"),
    (("etcd",), "elastic-run notice"),
])
def test_notice_source_precedence_and_a_clean_departure(tmp_path, given, reported):
    node = Node(tmp_path)

    def notices_arrive():
        node.rendezvous.on_look = lambda: None
        if "sigterm" in given:
            node.agent.request_stop(signal.SIGTERM)
        if "file" in given:
            node.notice_file.touch()
        if "cloud" in given:
            node.watcher.notice.set()
        if "etcd" in given:
            node.rendezvous.leaving.append(NODE)

    node.rendezvous.on_look = notices_arrive
    assert node.run() == 0
    assert [e["source"] for e in node.rendezvous.kinds("notice")] == [reported]
    assert "give_notice 0" in node.journal and node.journal[-1] == "leave"
    assert node.rendezvous.kinds("drain")[0]["ended"] == "progress"


def test_sigterm_without_a_notice_deadline_is_a_stop_not_a_notice(tmp_path):
    node = Node(tmp_path, notice_deadline_s=0.0)
    node.rendezvous.on_look = lambda: node.agent.request_stop(signal.SIGTERM)
    code = node.run()
    assert code == 128 + signal.SIGTERM and code in EXIT_CODES  # workers were stopped, not done
    assert not node.rendezvous.kinds("notice")
    assert node.journal.index("leave") < node.journal.index("signal SIGTERM")


# ---- draining ---------------------------------------------------------------------
def test_a_draining_node_leaves_only_after_its_workers_checkpointed(tmp_path):
    node = Node(tmp_path, steps_to_boundary=3)
    node.rendezvous.on_look = lambda: node.rendezvous.leaving.append(NODE)
    assert node.run() == 0
    exited = node.journal.index(f"workers exited {EXIT_FOR_RESIZE}: checkpointed at a step "
                                "boundary")
    assert exited < node.journal.index("leave")  # peers re-form from the newest checkpoint
    assert "stop" not in node.journal[:exited]
    assert node.rendezvous.kinds("drain")[0]["ended"] == "progress"


def test_workers_without_a_step_boundary_are_left_at_once(tmp_path):
    node = Node(tmp_path, boundary=False)
    node.rendezvous.on_look = lambda: node.rendezvous.leaving.append(NODE)
    assert node.run() == 0
    assert node.journal.index("leave") < node.journal.index("stop")  # peers need not wait
    assert node.rendezvous.kinds("drain")[0]["ended"] == "no-boundary"


# ---- exit codes -------------------------------------------------------------------
def test_workers_that_all_succeed_finish_the_run_with_0(tmp_path):
    node = Node(tmp_path, exits={0: 0, 1: 0})
    assert node.run() == 0
    assert node.journal[-2:] == ["finish", "leave"]
    assert [e["round"] for e in node.rendezvous.kinds("finished")] == [0]


def test_workers_are_told_the_runs_origin_asked_for_once(tmp_path):
    """Their checkpoint manifests carry it (folder_claim.py); once known, it is kept."""
    node = Node(tmp_path, max_restarts=1, exits={1: 3})
    assert node.run() == 6
    assert [job.run_origin for job in node.jobs] == ["0123456789abcdef"] * 2
    assert node.journal.count("origin") == 1


def test_workers_start_without_the_origin_while_etcd_cannot_give_it(tmp_path):
    """A secondary check's token must not stop a start: the run id still names the
    run's checkpoints, and the next start asks again."""
    node = Node(tmp_path, max_restarts=1, exits={1: 3})
    node.rendezvous.origin_answer = EtcdUnavailable("no etcd endpoint answered (fake)")
    assert node.run() == 6
    assert [job.run_origin for job in node.jobs] == ["", ""]
    assert node.journal.count("origin") == 2


def test_a_worker_failing_past_max_restarts_ends_with_6_naming_it(tmp_path):
    node = Node(tmp_path, max_restarts=1, exits={1: 3})
    assert node.run() == 6 and "more than --max-restarts" in EXIT_CODES[6]
    assert isinstance(node.error, WorkerFailure)
    assert str(node.error).startswith(
        f"worker global rank 1 (local rank 1) on node {NODE} exited with code 3; "
        "giving up after --max-restarts 1")
    assert [p.restart_count for p in node.started] == [0, 1]  # one restart, then give up
    assert [(f["rank"], f["exit_code"]) for f in node.rendezvous.failures] == [(1, 3), (1, 3)]


@pytest.mark.parametrize("during", ["rendezvous", "training"])
def test_sigint_stops_the_node_with_130(tmp_path, during):
    node = Node(tmp_path)
    if during == "rendezvous":
        node.agent.request_stop(signal.SIGINT)
    else:
        node.rendezvous.on_look = lambda: node.agent.request_stop(signal.SIGINT)
    assert node.run() == 130 and "SIGINT" in EXIT_CODES[130]
    assert node.journal[-1] == "leave"
    if during == "training":
        assert "signal SIGINT" in node.journal  # the workers got the same signal


def test_etcd_silent_past_the_grace_stops_workers_and_ends_with_4(tmp_path):
    node = Node(tmp_path, join_timeout_s=0.0)

    def etcd_goes_away():
        node.rendezvous.silent_s = 2.0 * LEASE_TTL_S + 1
        node.rendezvous.etcd_answers = False

    node.rendezvous.on_look = etcd_goes_away
    assert node.run() == 4 and "etcd unreachable" in EXIT_CODES[4]
    assert isinstance(node.error, EtcdUnavailable)
    assert node.journal.index("stop") < node.journal.index("ping")  # workers stopped first
    assert len(node.rendezvous.kinds("etcd_lost")) == 1


def test_a_host_that_stalled_past_the_grace_asks_etcd_before_stopping_its_workers(tmp_path):
    """The keep-alive's last answer is old because this host was frozen (SIGSTOP,
    swapping), not because etcd went away: etcd answers the one question, so the
    workers train on and finish; nothing is stopped, nobody waits for etcd."""
    node = Node(tmp_path, exits={0: 0, 1: 0})
    node.rendezvous.silent_s = 2.0 * LEASE_TTL_S + 1
    node.rendezvous.etcd_answers = True
    assert node.run() == 0
    assert "asked" in node.journal and "ping" not in node.journal and "stop" not in node.journal
    assert node.rendezvous.kinds("etcd_lost") == []
    assert [p.round for p in node.started] == [0]


def test_etcd_back_within_the_join_timeout_re_forms_the_job(tmp_path):
    node = Node(tmp_path, exits={0: 0, 1: 0})
    node.rendezvous.silent_s = 2.0 * LEASE_TTL_S + 1   # the first round's grace is spent
    node.rendezvous.etcd_answers = False

    def etcd_returns():
        node.rendezvous.silent_s, node.rendezvous.etcd_answers = 0.0, True

    node.rendezvous.on_ping = etcd_returns  # the first ping fails, the retry is answered
    assert node.run() == 0
    assert node.journal.count("ping") == 2
    assert [p.round for p in node.started] == [0, 1]


def test_a_signal_ends_the_etcd_wait_at_once(tmp_path):
    node = Node(tmp_path, join_timeout_s=600.0)
    node.rendezvous.silent_s = 2.0 * LEASE_TTL_S + 1
    node.rendezvous.etcd_answers = False
    node.rendezvous.on_ping = lambda: node.agent.request_stop(signal.SIGINT)
    assert node.run() == 130  # not a 600 s wait: the retry stops on the signal
    assert node.journal.count("ping") == 1
