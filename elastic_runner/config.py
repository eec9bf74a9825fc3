"""Frozen configuration built once by the CLI and passed down.

Nothing below the CLI reads the environment or argv: every knob lives here, so a
test builds the exact configuration it needs without patching globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from elastic_runner.rendezvous.protocol import (  # noqa: F401  (re-exported)
    OLDER_SCHEMA_PREFIXES, SCHEMA_PREFIX, run_prefix,
)


@dataclass(frozen=True)
class EtcdConfig:
    """How to reach etcd. `endpoints` empty means: start an embedded etcd."""

    endpoints: tuple[str, ...] = ()
    timeout_s: float = 5.0
    # How long one logical call keeps retrying transient failures before it
    # surfaces as EtcdUnavailable.
    retry_deadline_s: float = 10.0
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    binary: str | None = None


@dataclass(frozen=True)
class RendezvousConfig:
    run_id: str
    node_id: str
    min_nodes: int = 1
    max_nodes: int = 1
    lease_ttl_s: int = 5
    join_timeout_s: float = 600.0
    # A round that has its minimum closes once no new node has appeared for this
    # long (a re-formation closes at once when every live node has joined), and
    # newcomers wait for the same quiet before opening a round, so a burst of
    # arrivals costs one re-formation, not one each; arrivals extend the wait
    # up to settle_max_s (below).
    settle_s: float = 2.0
    node_addr: str = "127.0.0.1"
    master_port: int | None = None
    # How long a new round waits for live members of the last one that have not
    # joined yet: they may be writing the checkpoint this resize resumes from.
    drain_timeout_s: float = 30.0
    nproc: int = 1
    min_workers: int = 0
    max_workers: int = 0
    labels: tuple[tuple[str, str], ...] = ()
    # Rank 0 goes to a member with this label when there is one.
    rank0_prefer: tuple[str, str] | None = ("lifecycle", "on-demand")
    settle_max_s: float = 30.0

    @property
    def prefix(self) -> str:
        return run_prefix(self.run_id)


@dataclass(frozen=True)
class WorkerConfig:
    """What to run on this node and how to stop it."""

    argv: tuple[str, ...]
    nproc: int
    # Fingerprint of the job (script bytes + args); agents of one run must agree.
    fingerprint: str
    stop_grace_s: float = 5.0
    monitor_interval_s: float = 0.1
    log_dir: Path | None = None
    gpu_count: int = 0
    extra_env: tuple[tuple[str, str], ...] = ()
    # A worker whose er.report() progress is older than this is hung (None: off).
    worker_timeout_s: float | None = None


@dataclass(frozen=True)
class CloudNoticeConfig:
    """Where this node learns of its own spot reclaim: the cloud's metadata service
    (--notice-from, --notice-url). See cloud_notice.py for each cloud's protocol."""

    cloud: str  # "aws", "gcp" or "azure"
    # Scheme and host (and an optional path prefix) of the metadata service, no
    # trailing slash; the cloud's documented address unless --notice-url says otherwise.
    base_url: str
    # Seconds between the end of one poll and the start of the next; with a
    # request that runs into its timeout, a poll every interval_s to 2 * interval_s.
    interval_s: float = 1.0
    # Seconds each HTTP request to the metadata service may take.
    timeout_s: float = 1.0


@dataclass(frozen=True)
class AgentConfig:
    rendezvous: RendezvousConfig
    etcd: EtcdConfig
    workers: WorkerConfig
    max_restarts: int = 3
    verbosity: int = 1
    # After a spot notice (SIGTERM, --notice-file, `elastic-run notice`), how long
    # the workers get to write the emergency checkpoint before they are stopped.
    notice_deadline_s: float = 25.0
    notice_file: Path | None = None
    metrics_port: int | None = None
    # Prometheus exporters conventionally listen on every interface so a scraper on
    # another host can reach them; 127.0.0.1 keeps the endpoint on this node.
    metrics_addr: str = "0.0.0.0"
    # Signals the agent catches (torchrun's TORCHELASTIC_SIGNALS_TO_HANDLE, comma-separated).
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    # Poll this cloud's metadata service for a spot notice (--notice-from); None: off.
    cloud_notice: CloudNoticeConfig | None = None
