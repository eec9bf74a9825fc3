"""The spot-trace model behind bench/spot_model.py: a trace, its events, each launcher's
response to an event, and the discrete-event simulation that turns them into goodput.

Pure (no files read here besides a trace, nothing measured): spot_model.py builds the
parameters from the measured benchmarks and prints the tables.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path


BENCH = Path(__file__).resolve().parent
TRACES = sorted((BENCH / "traces").glob("aws-*"))
RESCALE = BENCH / "latest" / "rescale.json"
REPLAY = BENCH / "latest" / "spot_replay.json"


# ---- data ------------------------------------------------------------------------
@dataclass(frozen=True)
class Trace:
    name: str
    points: tuple   # ((t, count), ...) change points, sorted, first at the trace's start
    end: float


@dataclass(frozen=True)
class Event:
    t: float
    kind: str       # "notice" (reclaim after SIGTERM) | "kill" (SIGKILL) | "join"
    before: int
    after: int


@dataclass(frozen=True)
class Job:
    """The training job and the cluster: what any launcher's restart or resize costs."""
    restart_floor_s: float        # fresh process to first step, without loading the checkpoint
    checkpoint_load_s: float
    checkpoint_interval_s: float  # of training time
    checkpoint_save_s: float      # blocking part of a save on notice or join (er.Checkpointer)
    step_s: float
    state_bytes: float            # one replica's training state: what a newcomer receives
    bandwidth_Bps: float          # node-to-node state transfer
    samples_per_node_s: float
    price_per_node_hour: float
    unnoticed_fraction: float     # share of reclaims that come without a usable notice

    def __post_init__(self):
        if not 0 <= self.unnoticed_fraction <= 1 or self.checkpoint_interval_s <= 0:
            raise ValueError("unnoticed_fraction in [0, 1] and checkpoint_interval_s > 0")


@dataclass(frozen=True)
class Response:
    """A launcher's answer to one event (rule 3). from_checkpoint: the job resumes from a
    checkpoint, so the periodic cadence restarts there. round_s: the first part of the pause,
    while the round is open and a newcomer still joins it (None: all of it, rule 5)."""
    pause_s: float
    lost: str = "checkpoint"
    lag_s: float = 0.0
    from_checkpoint: bool = True
    round_s: float | None = None


@dataclass(frozen=True)
class Torchrun:
    """torchrun, c10d rendezvous: every change restarts all workers (restart floor +
    checkpoint load), after its keep-alive / last-call waits."""
    key: str
    label: str
    keepalive_timeout_s: float    # a node that stopped heartbeating is dropped after this
    last_call_s: float            # below max nodes, a round waits this long for more
    join_detect_s: float          # waiting node noticed + round (max reached, no last call)
    start_rendezvous_s: float     # a fresh job's first round
    host_death_s: float           # store host lost: until every agent has exited
    dies_on_join: bool            # default c10d: the job dies after a join, restarted afresh
    join_death_s: float

    def respond(self, ev: Event, job: Job, max_nodes: int, p_host: float) -> Response:
        restart = job.restart_floor_s + job.checkpoint_load_s
        last_call = self.last_call_s if ev.after < max_nodes else 0.0
        fresh = self.start_rendezvous_s + last_call
        if ev.kind == "join":
            if ev.before == 0:
                return Response(fresh + restart, lost="none", round_s=fresh)
            if self.dies_on_join:
                return Response(fresh + restart, lag_s=self.join_death_s, round_s=fresh)
            return Response(self.join_detect_s + last_call + restart, round_s=self.join_detect_s + last_call)
        rdzv = p_host * (self.host_death_s + fresh) + (1 - p_host) * (self.keepalive_timeout_s + last_call)
        return Response(rdzv + restart, round_s=rdzv)


@dataclass(frozen=True)
class RestartElastic:
    """elastic-run today: every change stops and restarts the workers from a checkpoint."""
    key: str
    label: str
    kill_detect_s: float          # SIGKILL: until the dead node's lease expires
    rendezvous_s: float           # round after a notice (agent leaves at once)
    join_rendezvous_s: float      # round after a join
    start_rendezvous_s: float
    saves_on_notice: bool         # er.Checkpointer: save at the step boundary, re-do nothing

    def respond(self, ev: Event, job: Job, max_nodes: int, p_host: float) -> Response:
        restart = job.restart_floor_s + job.checkpoint_load_s
        if ev.kind == "join" and ev.before == 0:
            return Response(self.start_rendezvous_s + restart, lost="none", round_s=self.start_rendezvous_s)
        if ev.kind == "kill":
            rdzv = self.kill_detect_s + self.rendezvous_s
            return Response(rdzv + restart, round_s=rdzv)
        rdzv = self.join_rendezvous_s if ev.kind == "join" else self.rendezvous_s
        if self.saves_on_notice:
            return Response(rdzv + job.checkpoint_save_s + restart, lost="none", round_s=rdzv)
        return Response(rdzv + restart, round_s=rdzv)


@dataclass(frozen=True)
class InProcessElastic:
    """Issue 15's in-process re-formation: survivors keep their processes and state; a
    newcomer boots while the others train, then receives the state."""
    key: str
    label: str
    detection_s: float            # SIGKILL: survivors learn that a peer is gone
    reform_s: float               # new process group at the new size
    join_reform_s: float          # the same for a join, before the state transfer
    start_rendezvous_s: float     # from zero nodes: a restart like restart-based
    survivors_hold_state: bool    # data-parallel replicas: a SIGKILL loses one step only

    def respond(self, ev: Event, job: Job, max_nodes: int, p_host: float) -> Response:
        if ev.kind == "join" and ev.before == 0:
            return Response(self.start_rendezvous_s + job.restart_floor_s + job.checkpoint_load_s,
                            lost="none", round_s=self.start_rendezvous_s)
        if ev.kind == "join":
            return Response(self.join_reform_s + job.state_bytes / job.bandwidth_Bps, lost="none",
                            lag_s=job.restart_floor_s, from_checkpoint=False, round_s=self.join_reform_s)
        if ev.after == 0:        # no survivor holds the state: er.Checkpointer saves on a notice
            return Response(0.0, lost="none" if ev.kind == "notice" else "checkpoint")
        if ev.kind == "notice":
            return Response(self.reform_s, lost="none", from_checkpoint=False)
        if self.survivors_hold_state:
            return Response(self.detection_s + self.reform_s, lost="step", from_checkpoint=False)
        return Response(self.detection_s + self.reform_s + job.checkpoint_load_s)


@dataclass(frozen=True)
class Profile:
    name: str
    job: Job
    launchers: tuple
    sources: tuple    # (("job.restart_floor_s", "measured (...)"), ...)


@dataclass(frozen=True)
class EventCost:
    t: float
    kind: str
    before: int
    after: int
    lag_s: float       # trained on at the old size before stopping
    pause_s: float     # pause this event started or added (0: absorbed)
    lost_node_s: float


@dataclass(frozen=True)
class Timeline:
    key: str
    paid_node_s: float
    useful_node_s: float
    lost_node_s: float
    idle_node_s: float     # paid while the job did not train
    under_node_s: float    # paid nodes the training job did not use (fewer than available)
    paused_s: float        # wall time without training while nodes were paid
    stops: int
    events: tuple

    @property
    def goodput(self) -> float:
        return self.useful_node_s / self.paid_node_s if self.paid_node_s else 1.0


# ---- trace -----------------------------------------------------------------------
def load_trace(path: Path) -> Trace:
    """Change points of a shipped trace (formats: bench/traces/README.md). Raises OSError
    or ValueError saying what is wrong, so the CLI can print one line."""
    text = Path(path).read_text()
    if Path(path).suffix == ".json":
        try:
            doc = json.loads(text)
            gap = float(doc.get("metadata", {}).get("gap_seconds", 300))
            raw = [(i * gap, int(v)) for i, v in enumerate(doc["data"])]
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"expected {{'data': [counts]}} ({type(exc).__name__}: {exc})") from None
        end = len(raw) * gap
    else:
        raw = []
        for no, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    t, n = line.split(",")
                    raw.append((float(t), int(n)))
                except ValueError:
                    raise ValueError(f"line {no}: expected 'seconds,count', got {line[:40]!r}") from None
        end = max((t for t, _ in raw), default=0.0)
    if not raw or any(n < 0 for _, n in raw):
        raise ValueError("no rows, or a negative count")
    points: list = []
    for t, n in sorted(raw, key=lambda p: p[0]):
        if points and points[-1][0] == t:
            points[-1] = (t, n)
        elif not points or points[-1][1] != n:
            points.append((t, n))
    return Trace(Path(path).name, tuple(points), end)


def events_of(trace: Trace, unnoticed_fraction: float = 0.0) -> list[Event]:
    """One event per change (rule 1); drop number d is a SIGKILL when floor((d+1) f) >
    floor(d f), which spreads a fraction f evenly without randomness (rule 2)."""
    out, drops = [], 0
    for (_, before), (t, after) in zip(trace.points, trace.points[1:]):
        kind = "join"
        if after < before:
            f = unnoticed_fraction
            kind = "kill" if math.floor((drops + 1) * f) > math.floor(drops * f) else "notice"
            drops += 1
        out.append(Event(t, kind, before, after))
    return out


# ---- simulation ------------------------------------------------------------------
@dataclass
class _Sim:
    """Mutable state of one launcher's run through one trace (private to simulate)."""
    t: float
    w: int                            # world size while training; 0: no job
    ready_at: float | None = None     # paused until then
    stop_at: float | None = None      # a join's lag ends then
    pending: tuple | None = None      # (Response, Event) for stop_at
    round_end: float = 0.0            # a newcomer until then joins the open round
    queued: tuple | None = None       # (Response, row index): a later newcomer's round, next
    resets: bool = False              # the coming resume is from a checkpoint
    since_resume: float = 0.0
    useful: float = 0.0
    lost: float = 0.0
    idle: float = 0.0
    under: float = 0.0
    paused: float = 0.0
    stops: int = 0
    rows: list = field(default_factory=list)


def _advance(s: _Sim, until: float, a: int, job: Job) -> None:
    """Account [s.t, until) at the constant available count a, crossing scheduled stops and
    resumes on the way."""
    while s.t < until:
        nxt = min([x for x in (s.stop_at, s.ready_at) if x is not None and x < until], default=until)
        dt = nxt - s.t
        if s.ready_at is None:
            s.useful += s.w * dt
            s.under += (a - s.w) * dt
            s.since_resume += dt
        else:
            s.idle += a * dt
            s.paused += dt
        s.t = nxt
        if s.stop_at is not None and nxt == s.stop_at:
            _stop(s, *s.pending, job)
        elif s.ready_at is not None and nxt == s.ready_at and s.queued:
            r, i = s.queued                             # rule 5: the queued join's round
            _pause(s, r, nxt)
            s.rows[i] = replace(s.rows[i], pause_s=r.pause_s)
            s.queued, s.stops = None, s.stops + 1
        elif s.ready_at is not None and nxt == s.ready_at:
            s.ready_at, s.w = None, a
            if s.resets:
                s.since_resume = 0.0


def _lose(s: _Sim, lost_s: float) -> None:
    s.useful -= s.w * lost_s
    s.lost += s.w * lost_s


def _pause(s: _Sim, r: Response, t: float) -> None:
    s.ready_at = max(s.ready_at or t, t + r.pause_s)
    s.round_end = t + (r.pause_s if r.round_s is None else r.round_s)
    s.resets |= r.from_checkpoint


def _stop(s: _Sim, r: Response, ev: Event, job: Job) -> None:
    """Training stops now: the re-done work leaves the useful column (rule 3, 4)."""
    lost_s = {"checkpoint": s.since_resume % job.checkpoint_interval_s,
              "step": min(job.step_s, s.since_resume), "none": 0.0}[r.lost]
    _lose(s, lost_s)
    s.stop_at, s.pending, s.resets, s.stops = None, None, False, s.stops + 1
    _pause(s, r, s.t)
    s.rows.append(EventCost(ev.t, ev.kind, ev.before, ev.after, s.t - ev.t, r.pause_s, s.w * lost_s))


def _on_event(s: _Sim, ev: Event, r: Response, job: Job) -> None:
    """Rules 3, 5 and 7 for one event; every event leaves exactly one EventCost row."""
    def row(pause, e=ev):
        s.rows.append(EventCost(e.t, e.kind, e.before, e.after, s.t - e.t if e is not ev else 0.0, pause, 0.0))
    if s.stop_at is not None and ev.kind != "join":     # a loss ends a join's lag (rule 5)
        row(0.0, s.pending[1])
        s.stop_at = s.pending = None
    if ev.after == 0:                                   # rule 7: the job ends
        if s.ready_at is None and s.w > 0:
            _stop(s, replace(r, pause_s=0.0), ev, job)
        else:
            row(0.0)
        s.ready_at, s.queued, s.w, s.since_resume = None, None, 0, 0.0
    elif s.w == 0 and s.ready_at is None:               # rule 7: a fresh start
        s.resets = False
        _pause(s, replace(r, from_checkpoint=True), ev.t)
        row(r.pause_s)
    elif s.ready_at is not None and ev.kind == "join":  # rule 5: a join during a pause
        if ev.t > s.round_end and s.queued is None:
            s.queued = (r, len(s.rows))
        row(0.0)
    elif s.ready_at is not None:                        # rule 5: a loss during a pause
        if r.from_checkpoint and not s.resets:
            _lose(s, s.since_resume % job.checkpoint_interval_s)   # in-process state lost
        before, s.queued = s.ready_at, None             # a queued newcomer joins this round
        _pause(s, r, ev.t)
        row(s.ready_at - before)
    elif s.stop_at is not None:                         # rule 5: a join during a join's lag
        row(0.0)
    elif r.lag_s > 0:
        s.stop_at, s.pending = ev.t + r.lag_s, (r, ev)
    else:
        _stop(s, r, ev, job)


def simulate(trace: Trace, launcher, job: Job, max_nodes: int | None = None) -> Timeline:
    """One launcher through the whole trace at its own time scale (rules 1-8)."""
    top = max_nodes or max(n for _, n in trace.points)
    s = _Sim(t=trace.points[0][0], w=trace.points[0][1])
    paid, a = 0.0, s.w
    for ev in events_of(trace, job.unnoticed_fraction):
        paid += a * (ev.t - s.t)
        _advance(s, ev.t, a, job)
        p_host = 0.0 if ev.kind == "join" else min(1.0, (ev.before - ev.after) / ev.before)
        _on_event(s, ev, launcher.respond(ev, job, top, p_host), job)
        a = ev.after
    paid += a * (trace.end - s.t)
    _advance(s, trace.end, a, job)
    return Timeline(launcher.key, paid, s.useful, s.lost, s.idle, s.under, s.paused, s.stops,
                    tuple(s.rows))


def summary(tl: Timeline, job: Job) -> dict:
    samples = tl.useful_node_s * job.samples_per_node_s
    usd = job.price_per_node_hour * tl.paid_node_s / 3600
    kinds: dict = {}
    for e in tl.events:
        k = kinds.setdefault(e.kind, dict.fromkeys(("events", "pause_s", "lag_s", "lost_node_s"), 0))
        for name, v in (("events", 1), ("pause_s", e.pause_s), ("lag_s", e.lag_s), ("lost_node_s", e.lost_node_s)):
            k[name] += v
    return {"goodput": tl.goodput, "paid_node_h": tl.paid_node_s / 3600,
            "useful_node_h": tl.useful_node_s / 3600, "lost_node_h": tl.lost_node_s / 3600,
            "idle_node_h": tl.idle_node_s / 3600, "under_node_h": tl.under_node_s / 3600,
            "paused_h": tl.paused_s / 3600, "stops": tl.stops, "useful_samples": samples,
            "usd_per_1M_samples": usd / samples * 1e6 if samples else None, "by_kind": kinds}


