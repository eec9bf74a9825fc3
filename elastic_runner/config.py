"""Frozen configuration built once by the CLI and passed down.

Nothing below the CLI reads the environment or argv: every knob lives here, so a
test builds the exact configuration it needs without patching globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from elastic_runner.rendezvous.protocol import run_prefix

# Seconds one etcd call may take unless --etcd-timeout says otherwise.
DEFAULT_ETCD_TIMEOUT_S = 5.0
# The longest a stream of arrivals holds a round open unless --settle-max (or a
# longer --settle) says otherwise: the CLI and the torchrun plug-in share it.
DEFAULT_SETTLE_MAX_S = 30.0
# The shortest time a logical etcd call keeps retrying: an etcd leader election
# takes a second or two, and a client that gives up sooner turns it into an error.
MIN_RETRY_DEADLINE_S = 5.0
# The keep-alive never refreshes more often than this, however short the TTL.
MIN_KEEPALIVE_INTERVAL_S = 0.2


def etcd_grace_s(lease_ttl_s: float) -> float:
    """How long a lease holder tolerates etcd not answering: two TTLs.

    Why two: a live etcd drops our lease one TTL after the last refresh that
    reached it, and that refresh may have come up to a keep-alive interval
    before etcd went silent to us; past two TTLs the others have certainly
    re-formed without us. Through a whole-cluster outage etcd extends leases on
    the new leader, so a blip shorter than this costs no one their membership.
    """
    return 2.0 * lease_ttl_s


def retry_deadline_s(timeout_s: float, lease_ttl_s: float | None = None) -> float:
    """The one rule for how long a logical etcd call retries transient failures.

    A lease holder (an agent, the torchrun plug-in) retries as long as its etcd
    grace: giving up sooner would fail a node that is still a member, and longer
    is pointless, since past the grace the node stops its workers anyway. A client
    without a lease (a one-shot verb, a worker recording its checkpoint) retries
    for two full call timeouts, so one slow answer is retried once. Both wait at
    least MIN_RETRY_DEADLINE_S, the length of a leader election.
    """
    basis = etcd_grace_s(lease_ttl_s) if lease_ttl_s is not None else 2.0 * timeout_s
    return max(basis, MIN_RETRY_DEADLINE_S)


def keepalive_interval_s(lease_ttl_s: float) -> float:
    """How often a lease is refreshed: three times per TTL.

    Why a third: two refreshes in a row may fail (a slow etcd, a CPU-starved host)
    before the lease expires. The floor keeps a sub-second TTL from hammering etcd.
    """
    return max(lease_ttl_s / 3.0, MIN_KEEPALIVE_INTERVAL_S)


@dataclass(frozen=True)
class EtcdConfig:
    """How to reach etcd. `endpoints` empty means: start an embedded etcd.

    Build it with `EtcdConfig.build`, which derives the retry deadline by the one
    rule (`retry_deadline_s`); the plain constructor is for tests that need an
    exact deadline. A copy with another endpoint is `dataclasses.replace`.
    """

    endpoints: tuple[str, ...] = ()
    timeout_s: float = DEFAULT_ETCD_TIMEOUT_S
    # How long one logical call keeps retrying transient failures before it
    # surfaces as EtcdUnavailable.
    retry_deadline_s: float = 10.0
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    binary: str | None = None

    @classmethod
    def build(cls, endpoints: tuple[str, ...], timeout_s: float = DEFAULT_ETCD_TIMEOUT_S, *,
              lease_ttl_s: float | None = None, cacert: str | None = None,
              cert: str | None = None, key: str | None = None, user: str | None = None,
              password: str | None = None, binary: str | None = None) -> EtcdConfig:
        """The configuration of every etcd client the project opens.

        `lease_ttl_s`: the TTL of the lease this client keeps alive, or None when it
        holds none; it decides the retry deadline (see `retry_deadline_s`).
        """
        return cls(tuple(endpoints), timeout_s, retry_deadline_s(timeout_s, lease_ttl_s),
                   cacert or None, cert or None, key or None, user or None, password, binary)


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
    settle_max_s: float = DEFAULT_SETTLE_MAX_S
    # A round opened because a survivor's collective failed (MEMBER_SUSPECTED)
    # leaves out members of the last plan that have not joined this long after it
    # opened, instead of waiting for a dead node's lease (decisions.py). Why 1 s:
    # a live agent joins within milliseconds of seeing the round open (its paused
    # workers need not stop first), so 1 s spares a busy host; and 1 s plus the
    # re-formation stays within issue 15's 1.5 s from a SIGKILL to the first step
    # at the smaller size, whatever the lease TTL. One dropped wrongly joins the
    # next round as a newcomer does.
    suspect_grace_s: float = 1.0
    # Agents that copy every key of the run and decide from them (rendezvous/
    # deputies.py): the closer and its backups. The rest copy only the round key,
    # so etcd's work per round grows with N, not N^2. Why 3: a closer and two
    # backups survive two simultaneous losses without waiting for a new deputy.
    deputies: int = 3
    # The driver UUIDs of the GPUs this node's workers use (cli/gpus.py), claimed in
    # etcd before the node announces itself (rendezvous/devices.py); () without GPUs.
    devices: tuple[str, ...] = ()

    @property
    def prefix(self) -> str:
        return run_prefix(self.run_id)

    @property
    def etcd_grace_s(self) -> float:
        """How long workers keep training while etcd does not answer (two TTLs;
        why: `etcd_grace_s` at module level)."""
        return etcd_grace_s(self.lease_ttl_s)

    @property
    def collective_timeout_s(self) -> int:
        """How long a worker's collective may block before it gives up on a silent peer.

        Why it exists: a frozen (SIGSTOPped, swapping) peer keeps its sockets open, so
        a collective waiting on it blocks until torch's timeout (10 minutes by default)
        and, with in-process re-formation, holds the survivors' pause as long. Why 4
        TTLs: the frozen node's lease expires after one and the next round opens
        within another, so a collective still blocked two TTLs later waits on a node
        that is already out. Why at least 10 s: a slow but healthy collective (a busy
        host, a large all-reduce over a slow link) must not pass for a dead peer.
        """
        return max(10, 4 * int(self.lease_ttl_s))

    @property
    def formation_timeout_s(self) -> int:
        """How long a worker re-forming in place waits for the new round's process group.

        Why shorter than a collective: every member was paused and assigned within
        moments of the others, so a member that has not come after this long never
        will (it was reclaimed, or died, after the round closed). The worker then
        pauses again in that round instead of failing, and the job re-forms without
        it; at churn like a spot trace's, waiting the collective timeout each time
        cost 20 s per lost round. Two TTLs (at least 5 s): the rendezvous' own
        patience with a node that does not answer.
        """
        return min(self.collective_timeout_s, max(5, 2 * int(self.lease_ttl_s)))

    @property
    def keepalive_interval_s(self) -> float:
        """How often this node's lease is refreshed (a third of the TTL)."""
        return keepalive_interval_s(self.lease_ttl_s)

    @property
    def write_visible_timeout_s(self) -> float:
        """How long a transaction waits to see its own write in the local mirror.

        Why wait: the next decision reads the mirror, and deciding before our own
        write shows there would act on the state it just replaced. Why the TTL: the
        watch delivers a write within milliseconds, so a mirror a whole TTL behind
        has a stalled watch; running out is not an error (the loop decides again
        from what the mirror shows next), and blocking longer than the liveness
        window would leave this node deaf to members that died meanwhile.
        """
        return float(self.lease_ttl_s)


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
    # Keep one interpreter per local worker with torch imported, ready for the next
    # start (agent/prewarm.py). Needs a Python entry point.
    prewarm: bool = False


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
