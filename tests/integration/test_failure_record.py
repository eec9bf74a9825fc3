"""The round's failure record on a real etcd: which worker the job's error names when
several die of one crash (rendezvous/failures.lost_a_peer, running.report_failure).

A worker that crashes takes its peers on other nodes down within milliseconds, and
their agents can report first: agents' clocks cannot order exits on two machines, so
the first report used to win even when it was a victim's. Now a report of a cause
replaces one of a lost peer, and nothing else replaces a record.
"""

from __future__ import annotations

import json
import threading

import pytest

from elastic_runner.config import EtcdConfig, RendezvousConfig
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.engine import EtcdRendezvous
from elastic_runner.rendezvous.failures import failure_message

GLOO_VICTIM = ("[rank1]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
               "pair.cc:553] Connection closed by peer [127.0.0.1]:56206. This is typically "
               "caused by a remote worker crashing.")


def failure(node: str, rank: int, last_line: str, **extra) -> dict:
    return {"node_id": node, "rank": rank, "local_rank": rank % 2, "exit_code": 1,
            "signal": None, "stderr_tail": ["Traceback (most recent call last):", last_line],
            "log_file": None, "stalled_s": None, "error": None, "frame": None, **extra}


VICTIM = failure("b", 1, GLOO_VICTIM)
CULPRIT = failure("a", 3, "SystemExit: injected failure at step 3 on rank 3")
ANOTHER_CAUSE = failure("b", 0, "ValueError: bad batch")


@pytest.fixture
def rendezvous(etcd):
    client = EtcdClient(EtcdConfig((etcd.endpoint,), timeout_s=5.0, retry_deadline_s=10.0))
    config = RendezvousConfig("failures", "a", min_nodes=1, max_nodes=2)
    yield EtcdRendezvous(client, config, p.JobSpec(1, 2, "test"), 0)
    client.close()


def recorded(rendezvous: EtcdRendezvous, number: int) -> dict:
    value = rendezvous._client.get(p.failure_key(rendezvous.prefix, number)).value
    return json.loads(value)


@pytest.mark.parametrize("order, named", [
    ((VICTIM, CULPRIT), CULPRIT),  # the victim's agent was first: the cause replaces it
    ((CULPRIT, VICTIM), CULPRIT),
    ((CULPRIT, ANOTHER_CAUSE), CULPRIT),  # two causes: the first report still wins
    ((VICTIM, failure("c", 2, GLOO_VICTIM)), VICTIM),  # only victims (the cause's node died)
    ((VICTIM, failure("a", 3, "", signal="SIGKILL", exit_code=-9)), "SIGKILL"),
], ids=["victim-first", "culprit-first", "two-causes", "only-victims", "a-killed-worker"])
def test_the_record_names_the_cause_whichever_agent_reports_first(rendezvous, order, named):
    for report in order:
        rendezvous.report_failure(7, report)
    got = recorded(rendezvous, 7)
    assert (got["signal"] == named) if isinstance(named, str) else (got == named)


def test_the_jobs_last_line_names_the_crashed_worker_not_its_victim(rendezvous):
    rendezvous.report_failure(2, VICTIM)
    rendezvous.report_failure(2, CULPRIT)
    line = failure_message(recorded(rendezvous, 2), 3)
    assert line.startswith("worker global rank 3 (local rank 1) on node a exited with code 1")
    assert "injected failure at step 3 on rank 3" in line


def test_victims_and_a_cause_racing_leave_the_cause(rendezvous, etcd):
    """Eight victims' agents and one culprit's, each with its own client, at once."""
    clients = [EtcdClient(EtcdConfig((etcd.endpoint,), 5.0, 10.0)) for _ in range(9)]
    config = RendezvousConfig("failures", "x", min_nodes=1, max_nodes=2)
    agents = [EtcdRendezvous(c, config, p.JobSpec(1, 2, "test"), 0) for c in clients]
    reports = [failure(f"v{i}", i, GLOO_VICTIM) for i in range(8)] + [CULPRIT]
    start = threading.Barrier(len(agents))

    def report(agent, record):
        start.wait()
        agent.report_failure(5, record)
    threads = [threading.Thread(target=report, args=pair) for pair in zip(agents, reports)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert recorded(rendezvous, 5) == CULPRIT
    finally:
        for client in clients:
            client.close()
