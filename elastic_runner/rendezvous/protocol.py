"""The rendezvous rules as pure functions: no I/O, no clocks, no project imports.

A round is numbered; agents join it under their lease; it closes once (a
create-if-absent plan written in the same transaction that flips the round to
closed). The rules below decide who is in a round, when it may close, and
whether the round that ended counts as a restart; ranks.py decides who gets which
rank, from the values here. Keeping them pure lets a test check a rule without
etcd, and lets every agent evaluate them on its own copy of the state and still
agree: only the closing transaction decides.
decisions.py turns these rules into what the engine does next (open, join,
close, wait, count a restart), also without I/O. A round's cause is a `Cause`
value; the round key and the plan hold its one text.

Choices written down here:
- A round closes when it holds --max-nodes joiners; or, after the first round,
  as soon as every live registered node has joined (a re-formation needs no wait
  when nobody else is coming); or when --min-nodes is met, every live node has
  joined and none has registered for the settle time (all capped at
  --settle-max after the minimum was met), unless live members of the previous
  plan are still missing and the drain timeout (they may be checkpointing for
  this very resize) has not passed.
- A node outside a closed plan with room is admitted by the next round, opened
  at once when no other node registered within the settle time, but during a
  burst of arrivals only after that much quiet: a burst costs two re-formations
  (its first arrival's, then everyone else's), not one per node. The plan's
  first member opens it (it watched the newcomers arrive), the newcomer itself
  when that member is slow (decisions.py: `newcomer_wait`, `members_open_wait`).
- Times are never compared across machines. A registration's time is when the
  agent deciding first saw its node key, on that agent's own monotonic clock
  (wall clocks of different machines drift and step: one 60 s ahead made every
  join wait out --settle-max). A key that was already in etcd when an agent
  started watching counts as seen at that moment: the agent cannot know its
  age, and assuming it recent only delays (by at most the settle time), where
  assuming it old could split a burst into a round per node. etcd revisions,
  not times, order registrations (rank order, first joiner).
- A restart is counted only when workers failed and no member was lost: a crash
  that follows from a node vanishing is a membership change, not a failure.
- A round opened because a survivor's collective failed (MEMBER_SUSPECTED) does
  not wait for the dead node's lease: a member of the previous plan that has not
  joined within --suspect-grace of the round opening is left out (decisions.py:
  `suspect_left_out`). One wrongly dropped, being alive, joins the next round
  the way a newcomer does.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import asdict, dataclass
from functools import cached_property
from itertools import accumulate

from elastic_runner.rendezvous.job_spec import (  # noqa: F401 - read here as p.JobSpec
    RUN_PROTOCOL, JobSpec, spec_conflict,
)
from elastic_runner.rendezvous.member_table import Member, MemberTable

OPEN, CLOSED, FINISHED, FAILED = "open", "closed", "finished", "failed"

# ---- the key layout ------------------------------------------------------------------
# One prefix per schema version; everything of a run lives under run_prefix(run_id).
# v2: deputy slots under `round/`, a closed round's key carries its plan, plans are
# columnar (an agent of v1 could not read them, so the two must not share a run).
SCHEMA_PREFIX = "/elastic-runner/v2"
# Layouts of earlier versions: a run id found there belongs to an older runner.
OLDER_SCHEMA_PREFIXES = ("/elastic-runner/v0", "/elastic-runner/v1")


def run_prefix(run_id: str, schema: str = SCHEMA_PREFIX) -> str:
    return f"{schema}/{run_id}/"


def split_run_key(key: str) -> tuple[str, str] | None:
    """(run id, the key below its prefix) for a key of this schema, else None."""
    head = SCHEMA_PREFIX + "/"
    if not key.startswith(head):
        return None
    run_id, sep, rest = key[len(head):].partition("/")
    return (run_id, rest) if sep else None


def round_of(rest: str) -> int | None:
    """The round number of a key below a run prefix (`rounds/<n>/...`), else None."""
    parts = rest.split("/")
    if len(parts) < 3 or parts[0] != "rounds" or not parts[1].isdigit():
        return None
    return int(parts[1])


# ---- key names ------------------------------------------------------------------
def spec_key(prefix: str) -> str:
    return f"{prefix}spec"


def round_key(prefix: str) -> str:
    return f"{prefix}round"


def nodes_prefix(prefix: str) -> str:
    return f"{prefix}nodes/"


def node_key(prefix: str, node_id: str) -> str:
    return f"{nodes_prefix(prefix)}{node_id}"


def join_prefix(prefix: str, number: int) -> str:
    return f"{prefix}rounds/{number}/join/"


def join_key(prefix: str, number: int, node_id: str) -> str:
    return f"{join_prefix(prefix, number)}{node_id}"


def plan_key(prefix: str, number: int) -> str:
    return f"{prefix}rounds/{number}/plan"


# What a plan key holds once its round is two behind the newest closed one (the
# closing transaction writes it, engine.py). The key stays: a checkpoint writer of the
# round before is fenced by its existence (worker/checkpoint/etcd_store.py). The bytes
# go: a plan is 8-21 KB at 1,024 members, a spot fleet closes rounds every few minutes,
# and the deputies' copies and every resync read every key of the run.
SUPERSEDED_PLAN = b""
# Rounds whose plans stay whole: the newest closed one and the one before it (a round
# is decided against its previous plan).
PLANS_KEPT = 2


def plan_from(raw: bytes) -> "Plan | None":
    """A plan key's value as a Plan; None once it was superseded."""
    return None if raw == SUPERSEDED_PLAN else Plan.from_json(raw)


def failure_key(prefix: str, number: int) -> str:
    return f"{prefix}rounds/{number}/failure"


def notice_prefix(prefix: str) -> str:
    return f"{prefix}notice/"


def notice_key(prefix: str, node_id: str) -> str:
    return f"{notice_prefix(prefix)}{node_id}"


def device_key(prefix: str, uuid: str) -> str:
    """A GPU of this run's nodes, by its driver UUID, held under the lease of the node
    whose workers use it (rendezvous/devices.py: two agents on one machine)."""
    return f"{prefix}devices/{uuid}"


def deputy_prefix(prefix: str) -> str:
    """Lease-bound slots of the agents that watch every key (rendezvous/deputies.py)."""
    return f"{prefix}round/deputy/"


def shared_range(prefix: str) -> tuple[str, str]:
    """The key range every agent watches: notice/*, round, round/* (not rounds/*)."""
    return notice_prefix(prefix), f"{prefix}round0"


def checkpoint_key(prefix: str) -> str:
    return f"{prefix}checkpoint/latest"


def origin_key(prefix: str) -> str:
    """A random token written once with the run's spec: which launch of the run id this
    is. The same command started on two nodes that each run their own etcd is two jobs
    under one run id; their checkpoint manifests tell them apart by it
    (worker/checkpoint/folder_claim.py). In shared_range, so every agent's start read
    brings it; it never changes, so it costs no events."""
    return f"{prefix}origin"


def inplace_key(prefix: str) -> str:
    """Present once some worker of the run re-formed in place (its script can): a node
    that joins later starts its workers before announcing itself (agent/standby.py)."""
    return f"{prefix}inplace"


def store_prefix(prefix: str, number: int) -> str:
    """Where torch's control-plane store of a round lives (torchrun plug-in)."""
    return f"{prefix}rounds/{number}/store/"


def events_prefix(prefix: str) -> str:
    return f"{prefix}events/"


def event_key(prefix: str, time_ns: int, node_id: str) -> str:
    return f"{events_prefix(prefix)}{time_ns:020d}-{node_id}"


def is_passive_key(key: str) -> bool:
    """Keys that record (torch's store, the event log) but decide nothing. Judged
    below the run prefix: a run id such as "store" or "events" is a valid id."""
    split = split_run_key(key)
    if split is None:
        return False
    rest = split[1]
    return rest.startswith("events/") or (
        round_of(rest) is not None and rest.split("/")[2] == "store")


def node_id_from_key(key: str) -> str:
    return key.rsplit("/", 1)[-1]


# ---- round causes ---------------------------------------------------------------
class CauseKind(enum.Enum):
    """Why a round opened or a plan stopped holding; the value is the text etcd holds."""

    START = "start"
    MEMBER_LOST = "member-lost"
    # A survivor's collective failed (a peer died or hung) before any lease expired:
    # evidence, not proof. The detail says who saw what; decisions.py says how long
    # the round waits for the previous plan's members (--suspect-grace).
    MEMBER_SUSPECTED = "member-suspected"
    NEWCOMER = "newcomer"
    WORKER_FAILURE = "worker-failure"
    NOTICE = "workers checkpointed and stopped for a spot notice"
    ETCD_OUTAGE = "etcd outage"
    LEASE_EXPIRED = "this node's lease expired"
    FINISHED = "workers succeeded"
    JOB_FAILED = "the job failed"
    OTHER = ""  # text no rule here writes (torchrun's plug-in, an older agent): kept whole


_LEGACY_LOST = re.compile(r"member\(s\) lost: (.*)", re.S)
_LEGACY_OPENED = re.compile(r"round \S+ opened \((.*)\)", re.S)


@dataclass(frozen=True)
class Cause:
    """A round's cause as a value: decisions compare `kind`, never parse text.

    `text()` is the one spelling, written into RoundState.cause / Plan.cause and
    logged; `parse` reads it back. Those fields stay text, so `status` and older
    agents of this schema read them unchanged. Texts older agents wrote ("member(s)
    lost: a, b", "round 3 opened (newcomer)") parse to their kind; anything else
    is OTHER with the text kept, never an error.
    """

    kind: CauseKind
    detail: str = ""

    def text(self) -> str:
        if self.kind is CauseKind.OTHER:
            return self.detail
        return f"{self.kind.value}: {self.detail}" if self.detail else self.kind.value

    __str__ = text

    @staticmethod
    def member_lost(nodes) -> "Cause":
        return Cause(CauseKind.MEMBER_LOST, ",".join(nodes))

    @staticmethod
    def newcomer(opener: str = "") -> "Cause":
        """A round for nodes outside the plan; `opener` names the outsider that opened
        it itself (empty when a member opened it): decisions.round_opener says why."""
        return Cause(CauseKind.NEWCOMER, opener)

    @staticmethod
    def member_suspected(observer: str, what: str) -> "Cause":
        """A survivor's evidence: `observer` (node, rank) saw `what` (a failed collective)."""
        return Cause(CauseKind.MEMBER_SUSPECTED, f"{observer}: {what}" if what else observer)

    @staticmethod
    def parse(text: str) -> "Cause":
        for kind in CauseKind:
            if kind is CauseKind.OTHER:
                continue
            if text == kind.value:
                return Cause(kind)
            if text.startswith(kind.value + ": "):
                return Cause(kind, text[len(kind.value) + 2:])
        lost = _LEGACY_LOST.fullmatch(text)
        if lost:
            return Cause.member_lost(node.strip() for node in lost.group(1).split(","))
        opened = _LEGACY_OPENED.fullmatch(text)
        if opened:
            return Cause.parse(opened.group(1))
        return Cause(CauseKind.OTHER, text)


# ---- values ---------------------------------------------------------------------
def first_round() -> "RoundState":
    """Round 0, open: what the first agent of a run writes (registration does it in its
    own transaction; decisions.round_action's CREATE_FIRST where it did not)."""
    return RoundState(0, OPEN, Cause(CauseKind.START).text())


def joins_in_place(round_value: bytes | None, marked: bool) -> bool:
    """Whether a node joining now starts its workers on standby before announcing
    itself (agent/standby.py): some worker of the run re-formed in place (`marked`:
    inplace_key is there) and the run has not finished."""
    return marked and round_value is not None and \
        RoundState.from_json(round_value).state != FINISHED


@dataclass(frozen=True)
class RoundState:
    number: int
    state: str
    cause: str = "start"
    detail: str = ""

    def to_json(self) -> bytes:
        """The round key's value without a plan (carried_plan.round_value adds one)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @staticmethod
    def from_json(raw: bytes) -> "RoundState":
        data = json.loads(raw)
        data.pop("plan", None)  # what a closed round carries: carried_plan.py reads it
        data.pop("plan_delta", None)
        return RoundState(**data)


@dataclass(frozen=True)
class Joiner:
    """A node's join record: where it can host the process-group store."""

    node_id: str
    addr: str
    port: int
    nproc: int
    join_revision: int = 0
    labels: tuple[tuple[str, str], ...] = ()

    def label(self, key: str) -> str:
        return dict(self.labels).get(key, "")

    def to_json(self) -> bytes:
        data = asdict(self)
        data.pop("join_revision")
        data["labels"] = dict(self.labels)
        return json.dumps(data, sort_keys=True).encode()

    @staticmethod
    def from_json(raw: bytes, join_revision: int) -> "Joiner":
        data = json.loads(raw)
        data["labels"] = tuple(sorted(data.get("labels", {}).items()))
        return Joiner(**data, join_revision=join_revision)


@dataclass(frozen=True)
class Plan:
    round: int
    members: tuple[Member, ...]
    master_addr: str
    master_port: int
    restart_count: int = 0
    cause: str = "start"
    _SCALARS = ("round", "master_addr", "master_port", "restart_count", "cause")  # not a field

    @cached_property  # asked several times a round by every agent, of 1,000s of members
    def columns(self) -> MemberTable:
        """The members as columns (member_table.py): what a plan read from etcd holds."""
        return MemberTable.of(self.members)

    @property
    def world_size(self) -> int:
        return sum(self.columns.nprocs)

    @property
    def node_ids(self) -> tuple[str, ...]:
        return self.columns.ids

    @cached_property
    def _index(self) -> dict[str, int]:
        return dict(zip(self.columns.ids, range(len(self.columns))))

    def member(self, node_id: str) -> Member | None:
        index = self._index.get(node_id)
        return self.columns[index] if index is not None else None

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    def to_dict(self) -> dict:
        """Format 2, columnar: every agent parses the plan each round, so ranks (order and
        nproc give them) are left out and a value all members share is written once."""
        ms, table = self.members, self.columns
        if not isinstance(ms, MemberTable) and [(m.node_rank, m.first_rank) for m in ms] != \
                list(zip(range(len(ms)), accumulate(table.nprocs, initial=0))):
            raise ValueError(f"round {self.round}: ranks do not follow from order and nproc")
        data = {f: getattr(self, f) for f in self._SCALARS + ("world_size",)}
        data.update(format=2, ids=list(table.ids))
        for key, column in (("nproc", list(table.nprocs)), ("addrs", list(table.addrs))):
            data[key] = column[0] if len(set(column)) == 1 else column
        if any(table.labels):
            data["labels"] = [dict(labels) for labels in table.labels]
        return data

    @staticmethod
    def from_json(raw: bytes) -> "Plan":
        return Plan.from_dict(json.loads(raw))

    @staticmethod
    def from_dict(data: dict) -> "Plan":
        """Also reads the per-member form of earlier agents: their plans stay in etcd."""
        try:
            members = _columns(data) if "format" in data else tuple(
                Member(**{**m, "labels": tuple(sorted(m.get("labels", {}).items()))})
                for m in data["members"])
            return Plan(members=members, **{f: data[f] for f in Plan._SCALARS})
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed plan record: {e!r}") from e

    def describe(self) -> str:
        def name(m: Member) -> str:
            tags = ",".join(f"{k}={v}" for k, v in m.labels)
            return f"{m.node_id}({tags})" if tags else m.node_id
        blocks = ", ".join(
            f"{name(m)}=ranks {m.first_rank}..{m.first_rank + m.nproc - 1}" for m in self.members
        )
        return (f"round {self.round}: world size {self.world_size} on {len(self.members)} "
                f"node(s) [{blocks}], master {self.master_addr}:{self.master_port}")

    def event_fields(self) -> dict:
        """The fields of a `round_closed` event, on every path (restart, in place, deferred)."""
        return {"round": self.round, "world_size": self.world_size,
                "master": f"{self.master_addr}:{self.master_port}", "cause": self.cause,
                "restart_count": self.restart_count,
                "members": [{"node": m.node_id, "node_rank": m.node_rank,
                             "first_rank": m.first_rank, "nproc": m.nproc} for m in self.members]}


def _columns(data: dict) -> MemberTable:
    """Format 2's members, checked first: a wrong plan could give two workers one rank."""
    ids = data.get("ids")
    n = len(ids) if isinstance(ids, list) else -1
    nprocs, addrs, labels = (c if isinstance(c, list) else [c] * n for c in (
        data.get("nproc"), data.get("addrs"), data.get("labels", {})))
    problem = (data["format"] != 2 and f"format {data['format']!r} (this agent reads 2)"
               or n < 0 and "ids is not a list"
               or not len(nprocs) == len(addrs) == len(labels) == n and "columns differ in length"
               or not all(isinstance(s, str) for s in ids + addrs) and "ids/addrs not strings"
               or not all(type(k) is int and k >= 0 for k in nprocs) and "nproc not ints >= 0"
               or len(set(ids)) != n and "node ids repeat"
               or data.get("world_size", sum(nprocs)) != sum(nprocs) and "wrong world_size")
    if problem:
        raise ValueError(f"malformed plan record: {problem}")
    return MemberTable(ids, nprocs, addrs,
                       tuple(tuple(sorted(lb.items())) if lb else () for lb in labels))


# ---- decisions ------------------------------------------------------------------
@dataclass(frozen=True)
class CloseInputs:
    joined: int
    min_nodes: int
    max_nodes: int
    all_live_joined: bool
    first_round: bool
    settle_elapsed: bool
    # Live members of the previous plan have not joined yet but may still be
    # checkpointing for this resize (within the drain timeout): wait for them.
    members_draining: bool = False
    workers: int = 0
    min_workers: int = 0
    max_workers: int = 0


def may_close(inputs: CloseInputs) -> bool:
    if inputs.joined < inputs.min_nodes or inputs.workers < inputs.min_workers:
        return False
    if inputs.joined >= inputs.max_nodes or (inputs.max_workers and
                                             inputs.workers >= inputs.max_workers):
        return True
    if inputs.all_live_joined and not inputs.first_round:
        return True
    return inputs.settle_elapsed and not inputs.members_draining


def counts_as_restart(failed: bool, previous: tuple[str, ...], members: tuple[str, ...]) -> bool:
    return failed and set(previous) <= set(members)
