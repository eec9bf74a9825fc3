"""The typed error hierarchy and the one place that maps errors to exit codes.

Every failure a user can cause or meet has its own type, a message that says what
is wrong and what to do, and a documented exit code. Code below the CLI raises
these; only `exit_code_for` and the CLI decide what the user sees.
"""

from __future__ import annotations


class ElasticRunError(Exception):
    """Base of every error elastic-run reports to a user."""

    exit_code = 1


class ConfigError(ElasticRunError):
    """A flag or environment value is invalid (exit 2, like argparse)."""

    exit_code = 2


class DuplicateNodeId(ConfigError):
    """Another live agent of the same run already registered this --node-id (exit 2)."""


class DeviceInUse(ConfigError):
    """A GPU this node's workers would use is held by another live agent of the run
    (exit 2): two agents on one machine."""


class EtcdBinaryNotFound(ElasticRunError):
    """No etcd server binary to start the embedded etcd."""

    exit_code = 3


class EtcdError(ElasticRunError):
    """etcd could not be reached or answered in a way we cannot use."""

    exit_code = 4


class EtcdUnavailable(EtcdError):
    """No endpoint answered within the deadline."""


class EtcdFull(EtcdUnavailable):
    """etcd refused a write: its space quota is used up (its NOSPACE alarm).

    An outage of writes only: reads, lease keep-alives and revokes still work, so
    workers train on until something must be written, and the agent then waits as
    through an outage until an operator frees space and disarms the alarm."""


class EtcdAuthError(EtcdError):
    """etcd refused our credentials."""


class LeaseNotFound(EtcdError):
    """A request named a lease etcd no longer has (it expired or was revoked)."""


class RendezvousError(ElasticRunError):
    """The rendezvous could not produce a plan this node can act on."""

    exit_code = 5


class SpecMismatch(RendezvousError):
    """Another agent started this run_id with a different job."""


class SchemaMismatch(RendezvousError):
    """Keys under the prefix were written by another schema version."""


class RendezvousTimeout(RendezvousError):
    """Too few nodes joined within --join-timeout."""


class RunFinished(RendezvousError):
    """The run_id already finished; a new run needs a new id."""


class LeaseLost(RendezvousError):
    """Our lease expired: the others have re-formed without us."""


class WorkerFailure(ElasticRunError):
    """Workers failed more often than --max-restarts allows."""

    exit_code = 6


class CheckpointError(ElasticRunError):
    """Base of checkpoint failures, so a caller can catch one type."""


class CheckpointWriteError(CheckpointError):
    """A save could not complete; earlier checkpoints are untouched."""


class StaleWriterError(CheckpointError):
    """The latest store refused our record: a newer round owns the history."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step  # the refused checkpoint's


class GroupFormationError(ElasticRunError):
    """A worker's first process group did not form: a member of its round was lost, or
    rank 0's store failed."""


class NoPlaceYet(ElasticRunError):
    """A worker without a place in the run (started on standby, or its group deferred
    by er.init(defer_group=True)) began to train outside its @er.elastic function."""


class SamplerDrawnAhead(ElasticRunError):
    """An ElasticSampler is iterated ahead of training (a DataLoader's worker processes
    prefetching its batches) or inside a DataLoader worker: the position a checkpoint
    saves would not be the batches trained (er.ElasticDataLoader is the way)."""


class ShutdownRequested(ElasticRunError):
    """SIGTERM/SIGINT reached the agent; not a failure of the job."""

    exit_code = 130


EXIT_CODES = {
    0: "success: every worker on this node exited 0",
    1: "unexpected internal error (run with -v and report it)",
    2: "bad flag or environment value",
    3: "no etcd binary found for the embedded etcd",
    4: "etcd unreachable, refused our credentials, or answered unexpectedly",
    5: "rendezvous failed: spec mismatch, timeout below --min-nodes, run already finished",
    6: "workers failed more than --max-restarts times",
    130: "stopped by SIGINT before the job finished",
    143: "stopped by SIGTERM while workers had not exited 0",
}


def exit_code_for(error: BaseException) -> int:
    """Map an exception to the process exit code documented in EXIT_CODES."""
    if isinstance(error, ElasticRunError):
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return 130
    return 1
