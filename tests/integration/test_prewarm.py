"""--prewarm with real processes: the waiting interpreter (worker/prewarm.py) runs the
entry point as `python -u` would, and the agent's pool (agent/prewarm.py) hands it to
WorkerGroup.start only where its environment fits. No etcd: the plan is given."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_runner.agent.prewarm import WarmPool, warmable
from elastic_runner.agent.workers import WorkerGroup, standby_env
from elastic_runner.config import WorkerConfig
from elastic_runner.contract import PREWARM_MODULE, PYTHON_ENTRY, WorkerEnv
from elastic_runner.rendezvous.protocol import Member, Plan

PROBE = '''import json, os, sys
print(json.dumps({"torch_preloaded": "torch" in sys.modules,
                  "dynamo_preloaded": "torch._dynamo" in sys.modules, "argv": sys.argv,
                  "name": __name__, "path0": sys.path[0], "rank": os.environ.get("RANK"),
                  "pid": os.getpid(), "stdin": sys.stdin.read(),
                  "marker": os.environ.get("MARKER")}), flush=True)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
'''


@pytest.fixture
def probe(tmp_path) -> Path:
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    return script


def order(process: subprocess.Popen, argv: list[str], env: dict) -> tuple[int, dict]:
    out, err = process.communicate(json.dumps({"argv": argv, "env": env}).encode() + b"\n",
                                   timeout=120)
    assert err.decode().strip() == "" or process.returncode != 0, err.decode()
    return process.returncode, json.loads(out.decode().strip().splitlines()[-1])


def interpreter(cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen([*PYTHON_ENTRY, "-m", PREWARM_MODULE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd)


def test_a_waiting_interpreter_runs_a_script_as_python_would(probe):
    env = {**os.environ, "RANK": "5", "EXIT_CODE": "3"}
    code, seen = order(interpreter(), [str(probe), "--lr", "0.1"], env)
    assert code == 3
    assert seen["torch_preloaded"] is True and seen["name"] == "__main__"
    assert seen["dynamo_preloaded"] is True  # what a script's first optimizer imports
    assert seen["argv"] == [str(probe), "--lr", "0.1"]
    assert seen["path0"] == str(probe.parent) and seen["rank"] == "5" and seen["stdin"] == ""


def test_a_waiting_interpreter_runs_a_module_as_python_m_would(probe):
    env = {**os.environ, "PYTHONPATH": str(probe.parent)}
    code, seen = order(interpreter(cwd=probe.parent), ["-m", "probe", "x"], env)
    assert code == 0 and seen["name"] == "__main__"
    assert seen["argv"] == [str(probe), "x"]  # python -m puts the module's file first


def test_an_interpreter_let_go_without_an_order_runs_nothing():
    process = interpreter()
    out, _ = process.communicate(b"", timeout=120)
    assert process.returncode == 0 and out == b""


def test_only_python_entry_points_can_be_prewarmed():
    assert warmable((*PYTHON_ENTRY, "train.py")) and warmable((*PYTHON_ENTRY, "-m", "pkg"))
    assert not warmable(("./train.sh",)) and not warmable(PYTHON_ENTRY)
    with pytest.raises(ValueError, match="Python entry point"):
        WarmPool(("./train.sh",), lambda local: {}, 1)


def setup(probe: Path, tmp_path: Path, nproc: int = 2, extra_env=()):
    config = WorkerConfig(argv=(*PYTHON_ENTRY, str(probe)), nproc=nproc, fingerprint="f",
                          extra_env=tuple(extra_env), prewarm=True)
    job = WorkerEnv(run_id="job", reform_dir=str(tmp_path / "reform"))
    base = dict(os.environ)
    plan = Plan(round=2, members=(Member("a", 0, nproc, "127.0.0.1", 0),),
                master_addr="127.0.0.1", master_port=29500)
    pool = WarmPool(config.argv, lambda local: standby_env(base, local, job, config), nproc,
                    refill_delay_s=0.2)
    return config, job, base, plan, pool


def outputs(group: WorkerGroup, log_dir: Path) -> list[dict]:
    assert group.wait(120.0)
    return [json.loads(path.read_text().strip().splitlines()[-1])
            for path in sorted(log_dir.rglob("rank*.log"))]


def test_workers_start_in_the_waiting_interpreters_and_new_ones_wait_after(probe, tmp_path):
    config, job, base, plan, pool = setup(probe, tmp_path)
    config = dataclasses.replace(config, log_dir=tmp_path / "logs")
    pool.fill()
    waiting = sorted(p.pid for p, _ in pool._waiting.values())
    group = WorkerGroup.start(plan, "a", job, config, base, echo=False, prewarm=pool)
    assert sorted(group.pids) == waiting
    seen = outputs(group, tmp_path / "logs")
    assert [s["rank"] for s in seen] == ["0", "1"] and all(s["torch_preloaded"] for s in seen)
    deadline = time.monotonic() + 30
    while len(pool._waiting) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    fresh = sorted(p.pid for p, _ in pool._waiting.values())
    assert len(fresh) == 2 and not set(fresh) & set(waiting)  # refilled after the delay
    time.sleep(1.0)  # started on a thread that lives on: their parent-death signal holds
    dead = [(p.returncode, p.stderr.read()[-2000:]) for p, _ in pool._waiting.values()
            if p.poll() is not None]
    assert dead == []
    pool.close()
    assert pool._waiting == {}


def test_standby_workers_take_waiting_interpreters_and_nothing_is_refilled(probe, tmp_path):
    """A standby start means the run re-forms in place: its workers will survive
    resizes, so no successor is started for them."""
    config, job, base, _, pool = setup(probe, tmp_path, nproc=1)
    pool.fill()
    (waiting, _), = pool._waiting.values()
    group = WorkerGroup.start(None, "a", job, config, base, echo=False, prewarm=pool)
    assert group.pids == [waiting.pid]
    assert group.wait(120.0)
    time.sleep(1.0)  # five refill delays
    assert pool._waiting == {}
    pool.close()


def test_an_interpreter_whose_environment_no_longer_fits_is_replaced(probe, tmp_path):
    config, job, base, plan, pool = setup(probe, tmp_path, nproc=1)
    pool.fill()
    (stale, _), = pool._waiting.values()
    changed = dataclasses.replace(config, extra_env=(("MARKER", "new"),),
                                  log_dir=tmp_path / "logs")
    group = WorkerGroup.start(plan, "a", job, changed, base, echo=False, prewarm=pool)
    assert group.pids != [stale.pid] and stale.poll() is not None  # killed, not used
    seen = outputs(group, tmp_path / "logs")
    assert seen[0]["marker"] == "new" and seen[0]["torch_preloaded"] is False
    pool.close()


def test_a_closed_pool_starts_nothing_and_leaves_no_process(probe, tmp_path):
    *_, pool = setup(probe, tmp_path)
    pool.fill()
    processes = [p for p, _ in pool._waiting.values()]
    pool.close()
    pool.fill()
    pool.refill_later()
    assert all(p.poll() is not None for p in processes) and pool._waiting == {}
    assert pool.take(0, {}) is None


def test_prewarm_with_no_python_is_refused_in_one_line(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    done = subprocess.run([sys.executable, "-m", "elastic_runner", "--standalone", "--prewarm",
                           "--no-python", str(script)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "elastic-run: error: --prewarm needs a Python entry point: it starts Python with "
        "torch imported; drop --no-python or --prewarm"]
