"""The events file that every agent and worker of a job appends to (events.py).

One --log-dir often serves every node; on NFS, O_APPEND alone lets two machines'
lines overwrite each other, so each append takes a POSIX lock first. Locks are per
process, so the holder here is another process."""

from __future__ import annotations

import errno
import fcntl
import subprocess
import sys
import threading

import pytest

from elastic_runner.events import EventLog, read_jsonl

HOLD_LOCK = """
import fcntl, sys
with open(sys.argv[1], "a") as handle:
    fcntl.lockf(handle, fcntl.LOCK_EX)
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_an_event_waits_for_the_lock_another_writer_holds(tmp_path):
    path = tmp_path / "events.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        log = EventLog("a", "job7", path)
        writer = threading.Thread(target=log.emit, args=("round_closed",), kwargs={"round": 3})
        writer.start()
        writer.join(0.5)
        assert writer.is_alive() and path.read_text() == ""  # waits: no interleaving
        holder.stdin.write("\n")
        holder.stdin.flush()
        writer.join(10.0)
        assert not writer.is_alive()
    finally:
        holder.kill()
        holder.wait()
    [event] = read_jsonl(path)
    assert (event["node"], event["kind"], event["round"]) == ("a", "round_closed", 3)


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_file_system_without_locks_still_gets_every_event(tmp_path, monkeypatch, code):
    def no_locks(*args):
        raise OSError(code, "locks not available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    path = tmp_path / "events.jsonl"
    log = EventLog("a", "job7", path)
    for number in range(3):
        log.emit("round_closed", round=number)
    assert [e["round"] for e in read_jsonl(path)] == [0, 1, 2]


def test_an_unwritable_events_file_never_stops_the_caller(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog("a", "job7", path)
    path.mkdir()  # open() fails: the event is lost, the caller goes on
    assert log.emit("finished")["kind"] == "finished"


def test_a_lock_never_released_delays_an_event_by_at_most_the_bound(tmp_path):
    """A writer that died holding the lock on NFS keeps it until its lease ends (90 s
    on NFSv4): the agent's loop must not stall that long for an event."""
    import time

    from elastic_runner.events import LOCK_WAIT_S

    path = tmp_path / "events.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        started = time.monotonic()
        writer = threading.Thread(target=EventLog("a", "job7", path).emit, args=("failed",))
        writer.start()
        writer.join(60.0)  # the holder never lets go: it must give up on the lock
        assert not writer.is_alive()
        assert time.monotonic() - started >= LOCK_WAIT_S  # it did wait for the holder
    finally:
        holder.kill()
        holder.wait()
    assert [e["kind"] for e in read_jsonl(path)] == ["failed"]
