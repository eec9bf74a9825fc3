"""How a failed worker is described: one line for the log, one for the job's end.

Shared by the agent (its own workers) and the rendezvous (the failure record a
round left in etcd), so both say the same thing.
"""

from __future__ import annotations


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

