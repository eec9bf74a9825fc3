"""How a failed worker is described: one line for the log, one for the job's end.

Shared by the agent (its own workers) and the rendezvous (the failure record a
round left in etcd), so both say the same thing.
"""

from __future__ import annotations

# What a worker's last words say when it died because a peer did: its collective
# lost the connection (gloo: "[.../gloo/transport/tcp/pair.cc:553] Connection closed
# by peer [addr]:port. This is typically caused by a remote worker crashing"; NCCL:
# "remote process exited or there was a network error"; torch's store:
# DistNetworkError), or gave up waiting for a peer that hung (gloo: "Timed out waiting").
_PEER_LOST_SIGNS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                    "Broken pipe", "remote process exited", "DistNetworkError",
                    "Timed out waiting")
_LAST_WORDS = 3  # stderr lines read: a traceback ends with its exception


def lost_a_peer(failure: dict) -> bool:
    """The worker died because another one did, as far as its last words say.

    Why it matters: when a worker crashes, its peers on other nodes die of it within
    milliseconds, and their agents may report first; the job's error must still name
    the worker that crashed (running.report_failure lets a report of a cause replace
    one of a lost peer). A signal or a stall is never a lost peer: something ended or
    froze that worker itself."""
    if failure.get("signal") or failure.get("stalled_s"):
        return False
    words = [failure.get("error") or "", *(failure.get("stderr_tail") or [])[-_LAST_WORDS:]]
    return any(sign in str(line) for line in words for sign in _PEER_LOST_SIGNS)


def describe_exit(failure: dict) -> str:
    if failure.get("stalled_s"):
        return f"made no progress for {failure['stalled_s']:g} s (--worker-timeout)"
    if failure.get("signal"):
        return f"was killed by signal {failure['signal']}"
    how = f"exited with code {failure.get('exit_code')}"
    if failure.get("error"):
        # What torch's @record wrote: the exception and where it was raised, so the
        # one line names the cause even when stderr's tail is noise.
        how += f": {_one_line(failure['error'])}"
        if failure.get("frame"):
            how += f" (at {failure['frame']})"
    return how


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def failure_message(failure: dict, max_restarts: int) -> str:
    """The one line (plus stderr tail) that ends a job which keeps failing."""
    how = describe_exit(failure)
    head = (f"worker global rank {failure.get('rank')} (local rank {failure.get('local_rank')}) "
            f"on node {failure.get('node_id')} {how}; giving up after --max-restarts "
            f"{max_restarts}")
    tail = failure.get("stderr_tail") or []
    if failure.get("log_file"):
        head += f"; full log: {failure['log_file']}"
    return head + ("\n  last stderr lines:\n    " + "\n    ".join(tail) if tail else "")

