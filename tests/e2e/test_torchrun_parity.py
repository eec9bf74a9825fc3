"""Workers get what torchrun gives them: the same probe under both, compared key by key.

Allowed differences (README, "torchrun parity"): ELASTIC_RUN_* (the runtime's own
contract) and PYTHONUNBUFFERED exist only under elastic-run; values that name a run,
a port, a temporary path or a store location differ by nature.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

PROBE = """
import json, os, sys
os.makedirs(sys.argv[1], exist_ok=True)
with open(os.path.join(sys.argv[1], "rank%s.json" % os.environ["RANK"]), "w") as out:
    json.dump(dict(os.environ), out)
"""
ONLY_UNDER_ELASTIC_RUN = {"PYTHONUNBUFFERED"}
# Our own etcd-v3 plug-in, once torchrun loads its entry points, sets this in
# torchrun's environment (etcd/client.py); not something torchrun gives workers.
ONLY_UNDER_TORCHRUN = {"GRPC_ENABLE_FORK_SUPPORT"}
ONLY_UNDER_ELASTIC_RUN_PREFIX = "ELASTIC_RUN_"
VALUES_THAT_DIFFER = {
    "MASTER_ADDR",  # torchrun --standalone: localhost; elastic-run: rank 0's node address
    "MASTER_PORT",  # a free port each
    "TORCHELASTIC_RUN_ID",  # torchrun --standalone: a random uuid; elastic-run: --run-id
    "TORCHELASTIC_ERROR_FILE",  # a temporary path each
    "TORCHELASTIC_USE_AGENT_STORE",  # torchrun's agent hosts the store; ours: rank 0's
}


def clean_env() -> dict[str, str]:
    repo = str(Path(__file__).resolve().parents[2])
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/"),
            "PYTHONPATH": repo, "LANG": "C.UTF-8"}


def run_probe(launcher: list[str], script: Path, out: Path) -> dict[int, dict[str, str]]:
    done = subprocess.run([*launcher, "--nproc-per-node", "2", "--max-restarts", "3",
                           str(script), str(out)], env=clean_env(), capture_output=True,
                          text=True, timeout=120, cwd=script.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def test_environment_matches_torchrun_key_by_key(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    torchrun = run_probe([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--log-dir", str(tmp_path / "torchrun-logs")],  # not /tmp
                         script, tmp_path / "torchrun")
    ours = run_probe([sys.executable, "-m", "elastic_runner", "-q"], script, tmp_path / "er")
    for rank in (0, 1):
        theirs, mine = torchrun[rank], ours[rank]
        missing = set(theirs) - set(mine) - ONLY_UNDER_TORCHRUN
        extra = {k for k in set(mine) - set(theirs)
                 if k not in ONLY_UNDER_ELASTIC_RUN and not k.startswith(ONLY_UNDER_ELASTIC_RUN_PREFIX)}
        differ = {k: (theirs[k], mine[k]) for k in set(theirs) & set(mine)
                  if theirs[k] != mine[k] and k not in VALUES_THAT_DIFFER}
        assert (missing, extra, differ) == (set(), set(), {}), rank
        assert mine["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert mine["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
        assert mine["TORCHELASTIC_ERROR_FILE"].endswith(f"rank{rank}.json")
        assert "ELASTIC_RUN_ETCD_PASSWORD" not in mine


RECORDED_FAILURE = """
import os
from torch.distributed.elastic.multiprocessing.errors import record

def read_config(path):
    raise ValueError(f"bad learning rate in {path}")

@record
def main():
    if os.environ["RANK"] == "1":
        read_config("conf/lr.yaml")

main()
"""


def test_a_record_decorated_failure_names_its_exception_in_the_one_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(RECORDED_FAILURE)
    done = subprocess.run([sys.executable, "-m", "elastic_runner", "--nproc-per-node", "2",
                           "--max-restarts", "0", str(script)], env=clean_env(),
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 6, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("elastic-run: error:")]
    assert errors and ("worker global rank 1 (local rank 1)" in errors[-1])
    assert "exited with code 1: ValueError: bad learning rate in conf/lr.yaml " \
           "(at train.py:6 in read_config)" in errors[-1]


SIGNAL_CATCHER = """
import os, signal, sys, time
def caught(signum, frame):
    open(sys.argv[1], "w").write(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGHUP, caught)
open(sys.argv[1] + ".ready", "w").close()
time.sleep(60)
"""


def test_sighup_is_handled_like_torchrun_and_forwarded_to_workers(tmp_path):
    """TORCHELASTIC_SIGNALS_TO_HANDLE's default includes SIGHUP: the agent stops the node
    and its workers receive the same signal."""
    import signal
    import time

    script = tmp_path / "catcher.py"
    script.write_text(SIGNAL_CATCHER)
    seen = tmp_path / "seen"
    agent = subprocess.Popen([sys.executable, "-m", "elastic_runner", "-q", str(script),
                              str(seen)], env=clean_env(), cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not Path(str(seen) + ".ready").exists():
            assert agent.poll() is None and time.monotonic() < deadline, agent.stderr.read()
            time.sleep(0.1)
        agent.send_signal(signal.SIGHUP)
        assert agent.wait(timeout=60) == 128 + signal.SIGHUP
        assert seen.read_text() == "SIGHUP"
    finally:
        if agent.poll() is None:
            agent.kill()


TORCHRUN_STYLE = Path(__file__).resolve().parents[1] / "helpers" / "torchrun_style.py"
STEPS = 150  # the three re-formations are over by step ~25; the rest is world 1 alone


def test_an_unmodified_torchrun_script_survives_join_sigterm_and_sigkill(etcd, workdir):
    """No elastic_runner import: the script resumes from its own torch.save checkpoint
    after every re-formation, and finishes."""
    import time

    from tests.e2e.harness import Job

    ckpt = workdir / "ckpt.pt"
    job = Job(etcd.endpoint, workdir, run_id="plain", nproc=1, script=TORCHRUN_STYLE,
              script_args=("--out", str(workdir / "steps.jsonl"), "--ckpt", str(ckpt),
                           "--steps", str(STEPS)))
    try:
        job.start("a", "b")
        job.wait_world(2, min_steps=8)
        joined_at = time.time()
        job.start("c")
        job.wait_world(3, after=joined_at, min_steps=8)
        left_at = time.time()
        job.terminate("c")
        job.wait_world(2, after=left_at, min_steps=8)
        assert job.wait_exit("c", timeout=30) in (0, 143)
        killed_at = time.time()
        job.kill("b")
        job.wait_world(1, after=killed_at, min_steps=3)
        assert job.wait_exit("a", timeout=120) == 0, job.agent_log("a")[-3000:]
    finally:
        job.stop_all()
    rows = job.steps()
    last = max(rows, key=lambda r: r["t"])
    assert last["step"] == STEPS - 1 and last["total"] == STEPS  # every step counted once
    resumed = {r["resumed_from"] for r in rows}
    assert len(resumed) >= 4 and all(s % 5 == 0 for s in resumed)  # each round from its file
    assert {r["WORLD_SIZE"] for r in rows} >= {"1", "2", "3"}
