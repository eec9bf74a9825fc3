"""Issue 5's fault scenarios as schedules: etcd outages, cluster member loss,
agents killed mid-rendezvous."""

from __future__ import annotations

import time

import pytest

from elastic_runner.config import EtcdConfig
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.etcd.server import EmbeddedEtcdCluster
from tests.faults import at_step, kill_process, run_schedule, stop_etcd

pytestmark = [pytest.mark.e2e, pytest.mark.socket_probe]  # about the agents, not torch


def rounds_after(job, when: float) -> set[str]:
    return {r["ELASTIC_RUN_ROUND"] for r in job.steps() if r["t"] > when}


def test_short_etcd_restart_does_not_disturb_training_a_long_outage_stops_then_resumes(job, etcd):
    """One run, two etcd outages. A 1 s outage (plus restart) stays inside the lease
    grace (TTL 2 s -> 4 s): 80 steps later the round and the workers' PIDs are the same.
    Then an 8 s outage: the agents stop their workers, and once etcd is back the job
    re-forms in a later round with every agent still running. The first agent whose
    grace runs out stops its workers; the other's may fail on the broken group first
    (their peers are gone) and it restarts them, which is as good: no agent ends."""
    job.start("a", "b")
    formed = job.wait_world(4)
    fired = run_schedule(job, [at_step(job.steps()[-1]["step"] + 5, stop_etcd(etcd, 1.0))])
    outage = fired[0].time
    job.wait_for(lambda: max((r["step"] for r in job.steps() if r["t"] > outage),
                             default=0) > fired[0].step + 80, 60,
                 "80 steps after the outage")
    assert rounds_after(job, outage - 1) == {formed[0]["ELASTIC_RUN_ROUND"]}, \
        "short outage: the job re-formed"
    pids = {r["pid"] for r in job.steps() if r["t"] > outage - 1}
    assert pids == {r["pid"] for r in formed}, "short outage: a worker restarted"
    assert all(p.poll() is None for p in job.agents.values()), "short outage: an agent ended"
    for node in ("a", "b"):
        assert "workers stopped, waiting up to" not in job.agent_log(node), \
            f"short outage: {node} stopped its workers"

    fired = run_schedule(job, [at_step(job.steps()[-1]["step"] + 5, stop_etcd(etcd, 8.0))])
    rows = job.wait_world(4, after=fired[0].time + 8.0, timeout=60)
    assert int(rows[0]["ELASTIC_RUN_ROUND"]) > int(formed[0]["ELASTIC_RUN_ROUND"]), \
        "long outage: no re-formation"
    stopped = [n for n in ("a", "b") if "workers stopped, waiting up to" in job.agent_log(n)]
    assert stopped, "long outage: no agent stopped its workers"
    for node in {"a", "b"} - set(stopped):
        assert "exited with code" in job.agent_log(node), \
            f"long outage: {node} neither stopped its workers nor saw them fail"
    assert all(p.poll() is None for p in job.agents.values()), "long outage: an agent ended"


def test_a_join_after_etcd_compacted_its_history_and_restarted_still_resizes(job, etcd):
    """etcd compacts its history (auto-compaction: hourly in our Kubernetes template)
    past where the agents' watches stand after a quiet spell, then a restart breaks
    every watch stream: their resume revision is gone. Before, each watch retried it
    forever, the agents never saw another change and the newcomer waited alone."""
    job.start("a", "b")
    formed = job.wait_world(4)
    client = EtcdClient(EtcdConfig((etcd.endpoint,), timeout_s=2.0, retry_deadline_s=15.0))
    for i in range(50):  # another run's writes move the revision on; this run is quiet
        revision = client.put(f"/elsewhere/{i}", b"x")
    client.compact(revision)
    client.close()
    etcd.stop()
    etcd.start()
    job.start("c")
    rows = job.wait_world(6, after=time.time(), timeout=60)
    assert int(rows[0]["ELASTIC_RUN_ROUND"]) > int(formed[0]["ELASTIC_RUN_ROUND"])
    assert any("etcd compacted its history" in job.agent_log(node) for node in ("a", "b"))
    assert all(p.poll() is None for p in job.agents.values())


@pytest.fixture
def etcd_cluster(tmp_path):
    with EmbeddedEtcdCluster(3, data_parent=tmp_path) as cluster:
        yield cluster.members


def test_losing_the_etcd_leader_keeps_training(etcd_cluster, tmp_path):
    from tests.e2e.harness import Job

    endpoints = ",".join(m.endpoint for m in etcd_cluster)
    job = Job(endpoints, tmp_path, lease_ttl=3, collective="socket")
    try:
        job.start("a", "b")
        formed = job.wait_world(4)
        client = EtcdClient(EtcdConfig((etcd_cluster[0].endpoint,), 2.0, 5.0))
        leader = client.leader_endpoint()
        client.close()
        victim = next(m for m in etcd_cluster if m.endpoint == leader)
        fired = run_schedule(job, [at_step(job.steps()[-1]["step"] + 5, kill_process(victim))])
        job.wait_for(lambda: max((r["step"] for r in job.steps() if r["t"] > fired[0].time),
                                 default=0) > fired[0].step + 80, 60,
                     "80 steps after the leader was killed")
        assert rounds_after(job, fired[0].time - 1) == {formed[0]["ELASTIC_RUN_ROUND"]}
        pids = {r["pid"] for r in job.steps() if r["t"] > fired[0].time - 1}
        assert pids == {r["pid"] for r in formed}
    finally:
        job.stop_all()


def test_agent_killed_between_join_and_plan(job):
    job.settle = 6.0  # the round stays open long enough to lose a joiner
    job.start("a", "b", "c")
    job.wait_for(lambda: len(job.etcd_keys("rounds/0/join/")) == 3 or None, 30, "3 joiners")
    job.kill("c")
    rows = job.wait_world(4, timeout=60)
    assert {int(r["RANK"]) for r in rows} == set(range(4))
    assert job.etcd_get("rounds/0/plan") is not None  # the open round did close


def test_agent_killed_between_plan_and_start(job):
    job.start("a", "b", "c")
    job.wait_for(lambda: "round 0:" in job.agent_log("c") or None, 30, "c's plan")
    job.kill("c")
    rows = job.wait_world(4, after=time.time(), timeout=60)
    assert {int(r["RANK"]) for r in rows} == set(range(4))


def test_hung_worker_is_detected_and_the_round_restarted(job, tmp_path):
    from pathlib import Path

    from tests.e2e.harness import read_jsonl

    out = tmp_path / "hang.jsonl"
    job.nproc = 1
    job.script = Path(__file__).resolve().parents[1] / "helpers" / "hang_worker.py"
    job.script_args = ("--out", str(out))
    # 6 s: below the collective timeout (10 s at the harness's --lease-ttl 2), so the
    # hang is what is detected; above what a starved 2-core machine leaves between two
    # progress writes of a healthy worker (3 s was seen to restart it a second time).
    job.start("a", "b", worker_timeout=6, max_restarts=2)
    assert job.wait_exit("a", timeout=120) == 0 and job.wait_exit("b", timeout=30) == 0
    rows = read_jsonl(out)
    assert max(r["step"] for r in rows if r["restart"] == 0) < 10
    assert {r["step"] for r in rows if r["restart"] == 1} == set(range(30))
    logs = job.agent_log("a") + job.agent_log("b")
    assert "made no progress for" in logs


def test_two_runs_on_one_etcd_never_interfere(etcd, tmp_path):
    from tests.e2e.harness import Job

    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = Job(etcd.endpoint, tmp_path / "one", run_id="one", collective="socket")
    two = Job(etcd.endpoint, tmp_path / "two", run_id="two", nproc=1,
              collective="socket")
    try:
        one.start("a", "b")
        two.start("a", "b", "c")            # same node ids, other run
        rows_one, rows_two = one.wait_world(4), two.wait_world(3)
        assert {int(r["RANK"]) for r in rows_one} == set(range(4))
        assert {int(r["RANK"]) for r in rows_two} == set(range(3))
        assert {r["TORCHELASTIC_RUN_ID"] for r in one.steps()} == {"one"}
        assert {r["TORCHELASTIC_RUN_ID"] for r in two.steps()} == {"two"}
    finally:
        one.stop_all()
        two.stop_all()


def test_extra_nodes_wait_as_standbys_and_fill_a_gap(job):
    job.nproc, job.max_nodes = 1, 2
    job.start("a", "b")
    formed = job.wait_world(2)
    job.start("standby")
    job.wait_for(lambda: "standby" in job.node_keys() or None, 30, "the standby to register")
    # A newcomer with room would re-form the job within --settle (1 s); 60 steps of
    # 0.05 s on every rank, all in the same round, show that a full run did not.
    rows = job.wait_steps(60)
    assert {r["ELASTIC_RUN_ROUND"] for r in rows} == {formed[0]["ELASTIC_RUN_ROUND"]}
    assert {r["WORLD_SIZE"] for r in rows} == {"2"}
    assert job.agents["standby"].poll() is None        # waiting, not crashed
    assert "standby" in job.node_keys()                 # registered and alive...
    assert "standby=ranks" not in job.agent_log("standby")  # ...but in no plan yet
    killed_at = time.time()
    job.kill("b")
    job.wait_world(2, after=killed_at, timeout=60)
    plan = [l for l in job.agent_log("standby").splitlines() if "world size 2" in l]
    assert plan and "standby=ranks" in plan[-1]


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(job, tmp_path):
    from tests.e2e.harness import MLP

    ckpt = tmp_path / "ckpt"
    job.script, job.nproc = MLP, 1
    job.script_args = ("--samples", "640", "--global-batch", "16", "--checkpoint-dir",
                       str(ckpt), "--every", "10", "--steps", "30")
    job.start("first")
    assert job.wait_exit("first", timeout=90) == 0
    newest = sorted(ckpt.glob("step-*"))[-1]
    state = newest / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    job.script_args = job.script_args[:-1] + ("40",)
    job.start("second", run_id="again")
    assert job.wait_exit("second", timeout=90) == 0
    log = job.agent_log("second")
    assert "resuming after step 20" in log
    assert log.count(newest.name) == 1 and "sha256" in log  # one line names it and why
    assert newest.exists()                                   # kept for inspection


def test_worker_rank_1_failing_at_step_7_resumes_from_the_checkpoint(job, tmp_path):
    """An exact fault (no timing): rank 1 exits 3 as it reaches step 7. The round
    restarts from the checkpoint of step 5, the run finishes with every sample
    trained exactly once, and the failure is reported with rank 1 and code 3."""
    from collections import Counter
    from pathlib import Path

    from tests.e2e.harness import read_jsonl

    trace, logs = tmp_path / "trace.jsonl", tmp_path / "logs"
    samples, batch = 320, 8  # 40 steps
    job.script = Path(__file__).resolve().parents[1] / "helpers" / "style_worker.py"
    job.nproc, job.min_nodes = 1, 2
    job.script_args = ("--style", "due", "--trace", str(trace), "--every", "5",
                       "--checkpoint-dir", str(tmp_path / "ckpt"), "--samples", str(samples),
                       "--global-batch", str(batch), "--step-time", "0.02")
    job.fail_worker(rank=1, step=7, exit_code=3)
    job.start("a", "b", max_restarts=1, log_dir=logs)
    assert job.wait_exit("a", timeout=120) == 0 and job.wait_exit("b", timeout=30) == 0
    assert job.faults_fired() == [(1, 7)]

    rows = read_jsonl(trace)
    first, second = sorted({r["round"] for r in rows})  # one restart, nothing else
    before = [r for r in rows if r["round"] == first]
    assert max(r["step"] for r in before) == 6           # nobody finished step 7 there
    after = [r for r in rows if r["round"] == second]
    assert min(r["step"] for r in after) == 6            # resumed after checkpoint 5
    assert {r["world"] for r in rows} == {2}
    last_round = {r["step"]: r["round"] for r in sorted(rows, key=lambda r: r["round"])}
    effective = [r for r in rows if r["round"] == last_round[r["step"]]]
    seen = Counter(i for r in effective for i in r["indices"])
    assert set(seen) == set(range(samples)) and set(seen.values()) == {1}

    # Rank 0 may fail too, in the all-reduce its peer left: that is collateral.
    exited = {(e["rank"], e["exit_code"]) for e in read_jsonl(logs / "events.jsonl")
              if e["kind"] == "worker_exited"}
    assert (1, 3) in exited and {rank for rank, _ in exited} <= {0, 1}
    assert (0, 3) not in exited
