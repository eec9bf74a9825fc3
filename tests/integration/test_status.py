"""`elastic-run status` against a real etcd holding a real run (agents via the harness)."""

from __future__ import annotations

import json
import signal
import queue
import subprocess
import sys
import threading

import pytest

from elastic_runner.config import EtcdConfig
from elastic_runner.errors import RendezvousError
from elastic_runner.agent.launch import connect
from elastic_runner.cli.status import list_runs, run_status
from elastic_runner.rendezvous import protocol as p
from tests.e2e.harness import Job


@pytest.fixture
def job(etcd, tmp_path):
    created = Job(etcd.endpoint, tmp_path, run_id="status-run", nproc=1, max_nodes=3,
                  collective="socket")  # the table, not torch
    yield created
    created.stop_all()


def status_cli(endpoint: str, *flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elastic_runner", "status",
                           "--rdzv-endpoints", endpoint, *flags],
                          capture_output=True, text=True, timeout=timeout)


def test_json_shows_members_round_and_events(job):
    job.start("a", node_label=["zone=z1"])
    job.wait_world(1)
    done = status_cli(job.endpoint, "--run-id", job.run_id, "--json", "--events", "2")
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert (view["run_id"], view["state"], view["world_size"]) == ("status-run", "closed", 1)
    assert view["spec"]["min_nodes"] == 1
    assert len(view["origin"]) == 16 and int(view["origin"], 16) >= 0  # which launch
    [member] = view["members"]
    assert (member["node"], member["node_rank"], member["ranks"]) == ("a", 0, [0])
    assert member["labels"] == {"zone": "z1"}
    # etcd reports whole seconds left, rounded down: a live lease at --lease-ttl 2 may
    # read 0 (test_grpc_proxy.held_by_etcd); a gone one reads None here.
    assert member["live"] and member["lease_remaining_s"] >= 0 and member["joined_at"]
    assert view["waiting"] == []
    assert [e["kind"] for e in view["events"]] == ["round_closed"]  # a's own: its file only


def test_the_etcd_copy_holds_each_rounds_outcome_once_and_no_routine_event(job):
    """Three nodes: each round_closed once, from its plan's first member and without the
    member list; nothing every node does every round, nor `joined` (status reads the
    node key's registered_at). Before, every node copied every event under a lease of
    its own: at 1,024 nodes 81 MB of etcd's space per round (rendezvous/event_copy.py)."""
    job.start("a", "b", "c")
    job.wait_world(3)
    client = connect(EtcdConfig((job.endpoint,), 2.0, 5.0))
    try:
        prefix = p.run_prefix(job.run_id)
        def all_closed():  # the last round's copy is written just after its workers start
            kvs, _ = client.get_prefix(p.events_prefix(prefix))
            events = [(kv, json.loads(kv.value)) for kv in kvs]
            rounds = {e["round"] for _, e in events if e["kind"] == "round_closed"}
            state = p.RoundState.from_json(client.get(p.round_key(prefix)).value)
            return events if state.number in rounds else None
        events = job.wait_for(all_closed, 30, "the last round's round_closed in etcd")
        nodes = {p.node_id_from_key(kv.key): kv
                 for kv in client.get_prefix(p.nodes_prefix(prefix))[0]}
        closed = [(kv, e, p.Plan.from_json(client.get(p.plan_key(prefix, e["round"])).value))
                  for kv, e in events if e["kind"] == "round_closed"]
    finally:
        client.close()
    assert len({e["round"] for _, e, _ in closed}) == len(closed)  # once per round
    for kv, event, plan in closed:
        assert kv.key.endswith("-" + plan.node_ids[0]) and "members" not in event
        assert event["world_size"] == plan.world_size
    assert not {e["kind"] for _, e in events} & {"joined", "workers_started",
                                                  "reform_started", "drain"}
    client = connect(EtcdConfig((job.endpoint,), 2.0, 5.0))
    try:
        view = run_status(client, job.run_id)
    finally:
        client.close()
    assert {m["node"]: m["joined_at"] for m in view["members"]} == {
        node: json.loads(kv.value)["registered_at"] for node, kv in nodes.items()}


def test_table_output_and_run_listing(job):
    job.start("a")
    job.wait_world(1)
    table = status_cli(job.endpoint, "--run-id", job.run_id)
    assert table.returncode == 0, table.stderr
    assert "status-run" in table.stdout and "members" in table.stdout and "a" in table.stdout
    assert "(origin " in table.stdout
    listing = status_cli(job.endpoint, "--json")
    assert listing.returncode == 0, listing.stderr
    [run] = json.loads(listing.stdout)["runs"]
    assert (run["run_id"], run["state"], run["world_size"], run["nodes"]) == \
        ("status-run", "closed", 1, 1)
    assert "status-run" in status_cli(job.endpoint).stdout


def test_unknown_run_is_one_clear_error(etcd):
    done = status_cli(etcd.endpoint, "--run-id", "no-such-run")
    assert done.returncode == RendezvousError.exit_code
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-run" in lines[0] and "not found" in lines[0]
    client = connect(EtcdConfig((etcd.endpoint,), 2.0, 5.0))
    try:
        with pytest.raises(RendezvousError):
            run_status(client, "no-such-run")
        assert list_runs(client) == []
    finally:
        client.close()


def test_watch_rerenders_when_a_node_joins(job):
    job.start("a")
    job.wait_world(1)
    # SIGINT as a terminal's Ctrl-C finds it: a test run started in the background by a
    # non-interactive shell ignores SIGINT, the watcher would inherit that, and Python
    # then installs no KeyboardInterrupt handler (seen: the watcher ignored the SIGINT).
    # Set in the child's own Python, not by a preexec_fn (_process.bound_to_parent: why).
    with_ctrl_c = ("import runpy, signal, sys; signal.signal(signal.SIGINT, "
                   "signal.default_int_handler); sys.argv[0] = 'elastic-run'; "
                   "runpy.run_module('elastic_runner', run_name='__main__')")
    watcher = subprocess.Popen([sys.executable, "-c", with_ctrl_c, "status",
                                "--rdzv-endpoints", job.endpoint, "--run-id", job.run_id,
                                "--json", "--watch"], stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in watcher.stdout],
                     daemon=True).start()
    try:
        first = json.loads(lines.get(timeout=60))
        assert first["world_size"] == 1
        job.start("b")
        while True:  # each change in etcd prints a new view; wait for the grown world
            view = json.loads(lines.get(timeout=60))
            if view["world_size"] == 2 and view["state"] == "closed":
                break
        assert [m["node"] for m in view["members"]] == ["a", "b"]
    finally:
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(timeout=60) == 0  # a bound for a loaded machine, not a timing


def test_a_retracted_checkpoint_record_reads_as_none_verified(etcd):
    """After rot, the record is checkpoint_latest.NO_CHECKPOINT: status must not claim
    'step -1 at None'."""
    from elastic_runner.worker.checkpoint.latest import NO_CHECKPOINT

    client = connect(EtcdConfig((etcd.endpoint,), 2.0, 5.0))
    try:
        prefix = "/elastic-runner/v2/rotten/"
        client.put(prefix + "round", json.dumps({"number": 0, "state": "open",
                                                 "cause": "start"}).encode())
        client.put(prefix + "checkpoint/latest", json.dumps(NO_CHECKPOINT).encode())
        assert run_status(client, "rotten")["checkpoint"] == {
            "step": None, "url": None, "retracted": True}
    finally:
        client.close()
    done = status_cli(etcd.endpoint, "--run-id", "rotten")
    assert done.returncode == 0, done.stderr
    assert "none verified" in done.stdout and "step -1" not in done.stdout
