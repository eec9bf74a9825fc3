"""A worker that stops for a resize ends without the interpreter's teardown, and
without losing anything the script wrote (worker/quick_exit.py).

Real processes: the script below leaves files open, registers an exit handler,
starts a thread that writes late and prints without flushing, then leaves the way
a worker that stopped for a resize does."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastic_runner.agent.workers import job_env
from elastic_runner.config import AgentConfig, EtcdConfig, RendezvousConfig, WorkerConfig
from elastic_runner.contract import EXIT_FOR_RESIZE, WorkerEnv, variable

SCRIPT = textwrap.dedent("""
    import atexit, gzip, os, sys, threading, time
    from elastic_runner.worker import quick_exit

    out = sys.argv[1]
    if sys.argv[2] == "worker":
        quick_exit.enable()
    text = open(f"{out}/text.txt", "w")  # buffered, never closed
    text.write("last line\\n")
    binary = open(f"{out}/binary.bin", "wb")
    binary.write(b"x" * 1000)
    zipped = gzip.open(f"{out}/data.gz", "wt")  # text over gzip over a buffered file
    zipped.write("compressed\\n" * 100)


    class Teardown:
        def __del__(self, _open=open, _path=f"{out}/teardown"):  # builtins go first
            with _open(_path, "w") as marker:
                marker.write("ran")


    kept = Teardown()
    atexit.register(lambda: open(f"{out}/atexit", "w").close())


    def late():
        time.sleep(0.3)
        open(f"{out}/thread", "w").close()


    threading.Thread(target=late).start()
    print("printed", end="")  # stdout is a pipe: block-buffered, not flushed yet
    also_stdout = os.fdopen(1, "w")  # another file on descriptor 1, which it would close
    also_stdout.write("+fd1")
    try:
        quick_exit.exit_for_resize()
    finally:
        open(f"{out}/finally", "w").close()
""")


def _leave(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "leaver.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), str(tmp_path), mode],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("mode", ["worker", "elsewhere"])
def test_exit_for_resize_keeps_what_the_script_wrote(tmp_path, mode):
    done = _leave(tmp_path, mode)
    assert done.returncode == EXIT_FOR_RESIZE, done.stderr
    assert done.stdout in ("printed+fd1", "+fd1printed")  # each flushed, neither closed
    assert "Traceback" not in done.stderr and "ignored" not in done.stderr, done.stderr
    assert (tmp_path / "text.txt").read_text() == "last line\n"
    assert (tmp_path / "binary.bin").stat().st_size == 1000
    assert gzip.decompress((tmp_path / "data.gz").read_bytes()) == b"compressed\n" * 100
    for marker in ("finally", "atexit", "thread"):
        assert (tmp_path / marker).exists(), marker


def test_a_worker_skips_the_teardown_and_a_plain_process_does_not(tmp_path):
    """The evidence that the teardown (freeing every object) was skipped: a global's
    __del__, which an ordinary exit runs, never ran in the worker."""
    (tmp_path / "worker").mkdir()
    (tmp_path / "plain").mkdir()
    assert _leave(tmp_path / "worker", "worker").returncode == EXIT_FOR_RESIZE
    assert _leave(tmp_path / "plain", "elsewhere").returncode == EXIT_FOR_RESIZE
    assert not (tmp_path / "worker" / "teardown").exists()
    assert (tmp_path / "plain" / "teardown").read_text() == "ran"


def test_the_agent_asks_its_workers_for_the_quick_exit(tmp_path):
    rendezvous = RendezvousConfig(run_id="job7", node_id="a")
    config = AgentConfig(rendezvous, EtcdConfig(), WorkerConfig(argv=("t.py",), nproc=1,
                                                                 fingerprint="f"))
    job = job_env(config, EtcdConfig(), tmp_path, None)
    assert job.to_env()[variable("quick_exit")] == "True"
    assert WorkerEnv.from_env(job.to_env()).quick_exit is True
    assert WorkerEnv.from_env({}).quick_exit is False  # torchrun, a plain python run


def test_er_init_turns_it_on_only_where_the_agent_asked():
    code = ("import elastic_runner as er; from elastic_runner.worker import quick_exit; "
            "er.init(); print(quick_exit.enabled())")
    seen = {}
    for value in ("True", None):
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_RUN_")}
        if value is not None:
            env[variable("quick_exit")] = value
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        seen[value] = done.stdout.strip()
    assert seen == {"True": "True", None: "False"}


def test_a_file_that_fails_to_close_costs_one_line_not_the_others(tmp_path):
    """A full disk at the last flush: one line on stderr, the other files still
    closed, the exit code still the resize's."""
    script = tmp_path / "full_disk.py"
    script.write_text(textwrap.dedent("""
        import io, sys
        from elastic_runner.worker import quick_exit

        class FullDisk(io.RawIOBase):
            def writable(self):
                return True

            def close(self):
                raise OSError(28, "No space left on device")

        quick_exit.enable()
        doomed = FullDisk()
        kept = open(sys.argv[1], "w")
        kept.write("saved\\n")
        quick_exit.exit_for_resize()
    """))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "kept.txt")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_FOR_RESIZE
    assert (tmp_path / "kept.txt").read_text() == "saved\n"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0], done.stderr
