"""Process helpers shared by the agent and the embedded etcd."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Sequence

_SETPRIV = shutil.which("setpriv")  # util-linux: Debian and Ubuntu have it (essential)

# Where setpriv is missing: a Python that sets the signal, checks its parent is still
# the one that spawned it (a parent gone before the prctl would never send it), and
# execs the command. -I: none of the user's environment shapes this interpreter.
_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "try:\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "except OSError as error:\n"
    "    sys.exit(f'cannot run {sys.argv[2]}: {error.strerror}')\n"
)


def bound_to_parent(argv: Sequence[str]) -> list[str]:
    """The command line of a child that gets SIGKILL when the thread that spawned it
    ends: it execs `argv` in place, keeping its pid.

    Why: a SIGKILLed agent cannot clean up, and its workers (or its embedded etcd)
    would otherwise live on in a job that has re-formed without them.

    Why not a preexec_fn calling prctl: a preexec_fn makes CPython fork() and run its
    after-fork work (PyOS_AfterFork_Child) in the child of a process that has gRPC's
    and torch's threads, and now and then that child died of SIGSEGV before its exec
    (seen in the test suite: a refilled --prewarm interpreter, and a test's child, at
    -11 with nothing on stderr). `setpriv --pdeathsig KILL` sets the same signal
    after a plain fork/exec; where util-linux is missing, a short Python does (about
    20 ms more per start). Either sets it a moment after the fork, so a spawning
    thread that ends within those milliseconds is not watched.
    """
    if _SETPRIV:
        return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]
    return [sys.executable, "-I", "-c", _SHIM, str(os.getpid()), *argv]


def stop_process(process: subprocess.Popen | None, timeout_s: float = 5.0) -> None:
    """SIGTERM a server we started, by its PID; SIGKILL it if it has not gone in time."""
    if not process or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def stat_fields(pid: int | str) -> list[bytes] | None:
    """/proc/PID/stat from field 3 (state) on: index 0 is the state, 1 the ppid, 19
    the start time; None once the process is gone. The command name (field 2) may
    hold spaces and ')', so the fields are counted from its last ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()


def process_tree(root: int) -> list[int]:
    """`root` and its live descendants, parents first, as /proc shows them now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = stat_fields(entry)
        if fields is None:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    tree, index = [root], 0
    while index < len(tree):
        tree.extend(children.get(tree[index], ()))
        index += 1
    return tree


def signal_machine(root: int, signum: int) -> None:
    """Send `signum` to `root` and every descendant, as a crashing (SIGKILL) or
    freezing (SIGSTOP) machine would stop all of them at once.

    Why not os.killpg: the agent starts each worker in a session of its own (so that
    a Ctrl-C meant for the agent does not reach them), and a process group then
    holds the agent alone. SIGKILL would still end the workers (their parent-death
    signal), a moment later; SIGSTOP would freeze the agent and leave its workers
    running. The test harness and the chaos soak play machine faults with this.
    """
    for pid in process_tree(root):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
