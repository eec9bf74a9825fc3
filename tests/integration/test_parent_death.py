"""Children die with the thread that spawned them (_process.bound_to_parent), through
setpriv and through the Python stand-in for machines without it, and keep their pid."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from elastic_runner import _process

WAYS = ["setpriv", "python"]


@pytest.fixture(params=WAYS)
def way(request, monkeypatch):
    if request.param == "setpriv" and _process._SETPRIV is None:
        pytest.skip("no setpriv on this machine (util-linux): only the Python stand-in runs")
    if request.param == "python":
        monkeypatch.setattr(_process, "_SETPRIV", None)
    return request.param


def spawn_from_thread(holder: list) -> threading.Thread:
    """The thread outlives the spawn by 0.5 s, as the agent's threads do: the signal
    is set a moment after the fork, and a child whose spawning thread ended before
    that is already someone else's."""
    def spawn():
        holder.append(subprocess.Popen(_process.bound_to_parent(["sleep", "60"])))
        time.sleep(0.5)
    thread = threading.Thread(target=spawn)
    thread.start()
    return thread


def test_a_child_gets_sigkill_when_its_spawning_thread_ends(way):
    holder: list[subprocess.Popen] = []
    spawn_from_thread(holder).join()
    try:
        assert holder[0].wait(timeout=5) == -9
    finally:
        holder[0].kill()


def test_a_child_of_a_living_thread_lives_as_the_command_under_its_pid(way):
    child = subprocess.Popen(_process.bound_to_parent(["sleep", "60"]))
    try:
        time.sleep(0.5)
        assert child.poll() is None
        with open(f"/proc/{child.pid}/cmdline", "rb") as cmdline:
            assert cmdline.read().split(b"\0")[:2] == [b"sleep", b"60"]  # exec'd in place
    finally:
        child.kill()
        child.wait()


def test_a_command_that_cannot_run_fails_with_one_line(way, tmp_path):
    done = subprocess.run(_process.bound_to_parent([str(tmp_path / "missing")]),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing" in lines[0]
