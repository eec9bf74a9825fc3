"""The agent's process ends once its work is done, whatever the interpreter's own
shutdown would wait for.

A thread that never ends stands in for a library whose finalisers block (grpc's C
core under a daemon thread's stream): the process must still end with its exit code,
its last line printed and its events written. On the old `sys.exit(main())` both
runs below hang until the subprocess timeout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_runner.events import read_jsonl

# Loaded by every Python started with this folder on PYTHONPATH (the agent, and any
# Python worker: the failing worker below is not Python for that reason).
STUCK_THREAD = ("import threading\n"
                "threading.Thread(target=threading.Event().wait, name='stuck', "
                "daemon=False).start()\n")


@pytest.fixture
def stuck_env(tmp_path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STUCK_THREAD)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def test_an_agent_whose_job_failed_exits_with_its_code_despite_a_thread_that_never_ends(
        tmp_path, stuck_env):
    logs = tmp_path / "logs"
    done = subprocess.run(
        [sys.executable, "-m", "elastic_runner", "--standalone", "--no-python",
         "--max-restarts", "0", "--nproc-per-node", "1", "--run-id", "ends",
         "--log-dir", str(logs), shutil.which("false")],
        capture_output=True, text=True, timeout=90, env=stuck_env, cwd=tmp_path)
    assert done.returncode == 6, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("elastic-run: error: worker global rank 0 (local rank 0)")
    assert "giving up after --max-restarts 0" in last
    events = [e["kind"] for e in read_jsonl(logs / "events.jsonl")]
    assert events[-1] == "failed", events


def test_the_console_script_ends_on_bad_input_despite_a_thread_that_never_ends(stuck_env):
    script = Path(sys.executable).parent / "elastic-run"
    done = subprocess.run([str(script), "--nproc-per-node", "zero", "train.py"],
                          capture_output=True, text=True, timeout=30, env=stuck_env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "elastic-run: error: --nproc-per-node 'zero': use a positive integer or 'auto'"]


def test_an_internal_error_keeps_its_traceback_and_exit_code_1_despite_a_thread_that_never_ends(
        tmp_path, stuck_env):
    site = Path(stuck_env["PYTHONPATH"].split(os.pathsep)[0])
    with (site / "sitecustomize.py").open("a") as hook:
        hook.write("import elastic_runner.cli.run as run\n"
                   "def broken(args, environ):\n"
                   "    raise RuntimeError('injected internal error')\n"
                   "run.start = broken\n")
    done = subprocess.run([sys.executable, "-m", "elastic_runner", "--standalone", "train.py"],
                          capture_output=True, text=True, timeout=30, env=stuck_env,
                          cwd=tmp_path)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "RuntimeError: injected internal error"
