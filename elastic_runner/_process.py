"""Process helpers shared by the agent and the embedded etcd."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Runs in a child before exec: SIGKILL it when the spawning thread dies.

    Why: a SIGKILLed agent cannot clean up, and its workers (or its embedded
    etcd) would otherwise live on in a job that has re-formed without them.
    """
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux/glibc: children then outlive a SIGKILLed parent
