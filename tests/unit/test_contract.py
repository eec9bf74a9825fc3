"""The agent-worker contract: one WorkerEnv both sides build and read, torch's error file."""

from __future__ import annotations

import json
import subprocess
import sys

from elastic_runner.contract import (
    EXIT_FOR_RESIZE, ProgressWriter, WorkerEnv, progress_file, read_progress, variable)
from elastic_runner.rendezvous.failures import failure_message
from elastic_runner.agent.workers import read_error_file, worker_env
from tests.unit.test_workers import PLAN, envs
from elastic_runner.config import WorkerConfig
from elastic_runner.rendezvous.ranks import assign_ranks


def test_worker_env_round_trips_through_the_environment():
    sent = WorkerEnv(rank=5, local_rank=1, world_size=8, local_world_size=4, group_rank=1,
                     group_world_size=2, role_rank=5, role_world_size=8, master_addr="10.0.0.1",
                     master_port=29500, restart_count=2, max_restarts=3, run_id="job7",
                     error_file="/e/rank5.json", round=4,
                     etcd_endpoints=("http://a:2379", "http://b:2379"),
                     etcd_prefix="/elastic-runner/v2/job7/", etcd_cacert="ca.pem",
                     etcd_user="alice", etcd_password_file="/s/pw", notice_path="/s/notice",
                     progress_dir="/s/progress", events_path="/logs/events.jsonl")
    env = sent.to_env()
    assert WorkerEnv.from_env(env) == sent
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert env["ELASTIC_RUN_ETCD_ENDPOINTS"] == "http://a:2379,http://b:2379"
    assert sent.etcd_options == {"cacert": "ca.pem", "user": "alice"}


def test_outside_a_launcher_every_field_has_its_default():
    assert WorkerEnv.from_env({}) == WorkerEnv()
    assert WorkerEnv.from_env({"RANK": "3", "WORLD_SIZE": "4"}).rank == 3


def test_the_agents_password_never_reaches_a_worker():
    got = envs("a", 0, {"ELASTIC_RUN_ETCD_PASSWORD": "s3cret", "HOME": "/root"})
    assert all("ELASTIC_RUN_ETCD_PASSWORD" not in e and e["HOME"] == "/root" for e in got)


def test_nccl_async_error_handling_as_torchrun_sets_it():
    assert {e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] for e in envs("a", 0)} == {"1"}
    explicit = envs("a", 0, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert {e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] for e in explicit} == {"3"}


def test_each_worker_gets_its_own_error_file(tmp_path):
    config = WorkerConfig(argv=("python",), nproc=4, fingerprint="f")
    got = [worker_env({}, PLAN, r, WorkerEnv(run_id="j"), config, tmp_path)
           for r in assign_ranks(PLAN, "b")]
    assert [e[variable("error_file")] for e in got] == [
        str(tmp_path / f"rank{r}.json") for r in (4, 5, 6, 7)]


def test_the_exit_code_for_a_resize_is_ex_tempfail():
    assert EXIT_FOR_RESIZE == 75


# ---- progress files: the worker writes, the agent reads ---------------------------
def test_progress_writer_records_what_read_progress_returns(tmp_path):
    writer = ProgressWriter(progress_file(tmp_path, 3), min_interval_s=0)
    assert writer.write(10, 320, now=100.0)
    assert writer.write(12, 384, now=101.0, boundary=True)
    (record,) = read_progress(tmp_path)
    assert record == {"step": 12, "samples": 384, "time": 101.0, "boundary": True,
                      "stopping": None, "prev_step": 10, "prev_samples": 320, "prev_time": 100.0}
    assert writer.last == record
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank3.json"]  # no temporaries


def test_progress_writer_is_rate_limited_except_for_an_agreed_stop(tmp_path):
    writer = ProgressWriter(progress_file(tmp_path, 0), min_interval_s=3600)
    assert writer.write(1, 1, now=1.0)
    assert not writer.write(2, 2, now=2.0)
    assert writer.write(3, 3, now=3.0, stopping=3)  # the agent waits on it: written at once
    assert read_progress(tmp_path)[0]["stopping"] == 3


def test_progress_writer_failure_is_advisory(tmp_path):
    writer = ProgressWriter(tmp_path / "missing-dir" / "rank0.json", min_interval_s=0)
    assert writer.write(1, 1) is False  # no exception: progress must not stop training
    assert writer.last is None


def test_the_worker_side_writes_progress_without_importing_the_agent():
    probe = ("import sys, elastic_runner.worker.step_boundary, elastic_runner.contract; "
             "print(sorted(m for m in sys.modules if m.startswith('elastic_runner.agent')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


RECORDED = """
import sys
from torch.distributed.elastic.multiprocessing.errors import record

def load(path):
    raise FileNotFoundError(f"no shard at {path}")

@record
def main():
    load("/data/shard-7")

main()
"""


def test_torchs_record_decorator_is_read_into_the_failure_line(tmp_path):
    """A script decorated with torch's @record: its exception and failing frame reach the
    job's one-line failure message, not only the stderr tail."""
    script = tmp_path / "train.py"
    script.write_text(RECORDED)
    error_path = tmp_path / "error.json"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={"TORCHELASTIC_ERROR_FILE": str(error_path), "PATH": ""},
                          timeout=120)
    assert done.returncode == 1
    error, frame = read_error_file(error_path)
    assert error == "FileNotFoundError: no shard at /data/shard-7"
    assert frame == "train.py:6 in load"
    line = failure_message({"rank": 3, "local_rank": 1, "node_id": "n2", "exit_code": 1,
                            "error": error, "frame": frame}, max_restarts=3).splitlines()[0]
    assert line == ("worker global rank 3 (local rank 1) on node n2 exited with code 1: "
                    "FileNotFoundError: no shard at /data/shard-7 (at train.py:6 in load); "
                    "giving up after --max-restarts 3")


def test_unreadable_or_foreign_error_files_are_ignored(tmp_path):
    path = tmp_path / "e.json"
    assert read_error_file(path) == (None, None)
    path.write_text("{not json")
    assert read_error_file(path) == (None, None)
    path.write_text(json.dumps({"message": "plain text"}))
    assert read_error_file(path) == ("plain text", None)
    path.write_text(json.dumps([1, 2]))
    assert read_error_file(path) == (None, None)
