"""Prometheus metrics of one node's agent, and the progress files that feed them.

Why two sources: membership metrics (world size, rounds, restarts, rescale
pauses) come from the agent's own events, which `observe()` receives as they
are emitted; training speed comes from the workers, which must not talk to the
agent on their hot path. Each worker's `er.report(step, samples)` therefore
leaves its latest numbers in a small file (`<progress_dir>/rank<R>.json`), and
a custom collector turns those files into rates only when Prometheus scrapes.

Choices written down here:
- Every server has its own CollectorRegistry: two agents in one process (tests)
  or a restarted agent never collide in a global registry.
- A progress file holds the last two reports, so a rate needs no state in the
  collector and is right on the very first scrape.
- `elastic_run_steps_per_second` is the mean over this node's fresh ranks (they
  step in lockstep); `elastic_run_samples_per_second` is their sum (each rank
  counts the samples it trained). A rank whose last report is older than
  STALE_S (a paused job, a rank of an earlier round) counts as 0 steps/s; with
  no progress files at all the two metrics are absent rather than 0.
- Checkpoint metrics (`elastic_run_checkpoint_save_seconds`, `_age_seconds`,
  `_step`) come from `checkpoint.json`, which rank 0's er.Checkpointer writes
  into its node's progress folder after every verified save: only the agent of
  the node hosting rank 0 exports them. A save shows up in the histogram at the
  first scrape after it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from elastic_runner.contract import read_progress
from elastic_runner.rendezvous.protocol import Cause, CauseKind

STALE_S = 10.0
PAUSE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
SAVE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


# ---- progress files: written by workers (contract.ProgressWriter), read here -----
@dataclass(frozen=True)
class Rates:
    steps_per_s: float
    samples_per_s: float


def progress_rates(records: list[dict], now: float, stale_s: float = STALE_S) -> Rates | None:
    """Steps/s (mean over fresh ranks) and samples/s (sum); None without records."""
    if not records:
        return None
    steps, samples = [], []
    for record in records:
        span = record.get("time", 0) - record.get("prev_time", record.get("time", 0))
        if span <= 0 or now - record["time"] > stale_s:
            continue
        steps.append((record["step"] - record["prev_step"]) / span)
        samples.append((record["samples"] - record["prev_samples"]) / span)
    if not steps:
        return Rates(0.0, 0.0)
    return Rates(sum(steps) / len(steps), sum(samples))


class ProgressCollector:
    """Computes training speed from the progress files at scrape time."""

    def __init__(self, progress_dir: Path):
        self._dir = progress_dir

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rates = progress_rates(read_progress(self._dir), time.time())
        if rates is None:
            return
        yield GaugeMetricFamily("elastic_run_steps_per_second",
                                "Training steps per second on this node (mean over its ranks)",
                                value=rates.steps_per_s)
        yield GaugeMetricFamily("elastic_run_samples_per_second",
                                "Samples per second trained by this node's ranks",
                                value=rates.samples_per_s)


class CheckpointCollector:
    """Checkpoint age and save time from the file rank 0's Checkpointer writes
    into this node's progress folder (only the node hosting rank 0 has one)."""

    def __init__(self, progress_dir: Path, save_histogram: Histogram):
        self._path = progress_dir / "checkpoint.json"
        self._histogram = save_histogram
        self._last_seen: float | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            record = json.loads(self._path.read_text())
        except (OSError, json.JSONDecodeError):
            return
        if record.get("time") != self._last_seen:
            self._last_seen = record.get("time")
            self._histogram.observe(float(record.get("duration_s", 0.0)))
        yield GaugeMetricFamily("elastic_run_checkpoint_age_seconds",
                                "Seconds since rank 0 last wrote a verified checkpoint",
                                value=time.time() - float(record["time"]))
        yield GaugeMetricFamily("elastic_run_checkpoint_step", "Step of the newest checkpoint",
                                value=float(record["step"]))


# ---- membership metrics from the agent's events ----------------------------------
def restart_cause(text: str) -> str:
    """A small, fixed label set from a round's recorded cause (labels must not explode).

    By the cause's kind, not by words in its text: a node id such as 'newcomer-3'
    in "member-lost: newcomer-3" must not make a lost member count as a newcomer.
    """
    kind = Cause.parse(text).kind
    return _RESTART_LABELS.get(kind, "other")


_RESTART_LABELS = {CauseKind.NOTICE: "notice", CauseKind.NEWCOMER: "newcomer",
                   CauseKind.MEMBER_LOST: "member-lost", CauseKind.LEASE_EXPIRED: "member-lost",
                   CauseKind.MEMBER_SUSPECTED: "member-lost",
                   CauseKind.WORKER_FAILURE: "worker-failure"}


class MetricsServer:
    """An HTTP endpoint with this agent's metrics; `observe` is an EventLog listener."""

    def __init__(self, port: int, progress_dir: Path, host: str = "0.0.0.0"):
        self.registry = CollectorRegistry(auto_describe=True)
        self.world_size = Gauge("elastic_run_world_size", "Workers in the current round",
                                registry=self.registry)
        self.rounds = Counter("elastic_run_rounds", "Rounds this node took part in",
                              registry=self.registry)
        self.restarts = Counter("elastic_run_restarts",
                                "Times this node's workers were restarted, by cause",
                                ["cause"], registry=self.registry)
        self.reformations = Counter("elastic_run_reformations",
                                    "Times this node's workers re-formed in their own "
                                    "processes (er.elastic), by cause",
                                    ["cause"], registry=self.registry)
        self.pause = Histogram("elastic_run_rescale_pause_seconds",
                               "Seconds from stopping workers to restarting them on a resize",
                               buckets=PAUSE_BUCKETS, registry=self.registry)
        self.checkpoint_save = Histogram("elastic_run_checkpoint_save_seconds",
                                         "Seconds rank 0 spent writing a checkpoint",
                                         buckets=SAVE_BUCKETS, registry=self.registry)
        self.registry.register(ProgressCollector(progress_dir))
        self.registry.register(CheckpointCollector(progress_dir, self.checkpoint_save))
        self._seen_round = False
        self._server, self._thread = start_http_server(port, host, registry=self.registry)
        self.host = host
        self.port = self._server.server_address[1]

    def observe(self, record: dict) -> None:
        """Update the metrics from one event record (see events.py for the kinds)."""
        kind = record.get("kind")
        if kind == "round_closed":
            self.world_size.set(record.get("world_size", 0))
            self.rounds.inc()
            if self._seen_round:
                # A re-formation in place keeps the worker processes: not a restart.
                counter = self.reformations if record.get("inprocess") else self.restarts
                counter.labels(restart_cause(str(record.get("cause", "")))).inc()
            self._seen_round = True
        elif kind == "resize" and record.get("pause_s") is not None:
            self.pause.observe(float(record["pause_s"]))
        elif kind in ("finished", "failed"):
            self.world_size.set(0)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(port: int, progress_dir: Path, host: str = "0.0.0.0") -> MetricsServer:
    """Serve /metrics on host:port (port 0: a free port, reported as `.port`)."""
    return MetricsServer(port, Path(progress_dir), host)
