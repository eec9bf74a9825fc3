"""What the engine does next, decided by pure functions of what etcd holds and now.

engine.py reads its copy of etcd into plain values, asks a function here, and
acts on the answer (a transaction, a wait, an error); nothing here does I/O,
reads a clock or keeps state, so a test can check every decision without etcd
and every agent reaches the same one from the same values. It imports only
protocol.py (the values and the close rule), and lives beside it rather than in
it only to keep each module a size one can read through.

Choices written down here (today's behaviour, kept):
- The round's first joiner (lowest join revision) closes it; every other joiner
  closes only after the round has been closable for --settle on its own clock, in
  case the first is slow or hung. A closer that is not at --max-nodes first checks
  its copy of etcd against etcd's counts (it could miss a node that just joined).
- A restart is spent only when workers failed and no member of the previous plan
  went missing (lost or left); the job fails when one more would exceed
  --max-restarts, and only then (a plan that already carries more, written by an
  agent with a higher limit, is not failed for it).
- A node outside a closed plan has room while the plan holds fewer than
  --max-nodes members and its workers fit under --max-workers.
- Suspicion (issue 15): a survivor whose collective failed opens the next round
  at once with a MEMBER_SUSPECTED cause, long before a dead node's lease
  expires. Such a round stops waiting for a member of the previous plan that has
  not joined within --suspect-grace of the round opening (on the deciding
  agent's clock, from its first look at the open round, like the drain wait):
  without this the dead node's still-live key would hold the round for the
  drain timeout or --settle-max (30 s by default) or until its lease expires.
  The grace only shortens waits: every other rule (min/max nodes and workers,
  settle for newcomers, the closer election) holds as before, so a round never
  closes below --min-nodes. A member left out this way does not spend a
  restart (its absence is a membership change, protocol.counts_as_restart), and
  the next plan's first member does not open a round for it while its key lives
  on (`left_out_on_suspicion`): a dead node would only hold that round open
  until its lease expired. Alive, it finds itself outside the plan and opens the
  next round itself, exactly as a newcomer does (`outsider_action`), and that
  round waits for it (`round_opener`). Until its key goes (or it joins or opens
  a round), no later round waits for it at all
  (`RoundLook.suspects`): alive, it would have come back through a round of its
  own, and otherwise a resize soon after (a join, a notice) would wait out the
  lease of a node that has long been left behind.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass
from typing import Iterable, Mapping

from elastic_runner.rendezvous import protocol as p


@dataclass(frozen=True)
class RoundRules:
    """The flags the rules read (built once from RendezvousConfig)."""

    min_nodes: int
    max_nodes: int
    min_workers: int = 0
    max_workers: int = 0
    settle_s: float = 0.0
    settle_max_s: float = 0.0
    drain_timeout_s: float = 0.0
    # A suspected round's wait for members of the previous plan (see the docstring).
    suspect_grace_s: float = 0.0


# ---- the round key: what an agent waiting for a plan does ------------------------
class Act(enum.Enum):
    CREATE_FIRST = "create round 0"
    RUN_FINISHED = "the run finished"
    RUN_FAILED = "the run failed"
    OPEN_NEXT = "open the next round"
    IN_OPEN_ROUND = "join or close the open round"
    IN_CLOSED_ROUND = "read the closed round's plan"
    WAIT = "wait"


@dataclass(frozen=True)
class Action:
    act: Act
    cause: p.Cause | None = None  # OPEN_NEXT: what the new round records
    wait_s: float = 0.0  # WAIT: how long at most


def round_action(state: p.RoundState | None, previous_round: int | None,
                 cause: p.Cause) -> Action:
    """What a node waiting for a plan does about the round key.

    `previous_round`: the round of the plan this node last ran (None at start);
    a round key not past it means the change that ended that plan has not opened
    a round yet, so this node opens it with `cause`.
    """
    if state is None:
        return Action(Act.CREATE_FIRST, p.Cause(p.CauseKind.START))
    if state.state == p.FINISHED:
        return Action(Act.RUN_FINISHED)
    if state.state == p.FAILED:
        return Action(Act.RUN_FAILED)
    if previous_round is not None and state.number <= previous_round:
        return Action(Act.OPEN_NEXT, cause)
    return Action(Act.IN_OPEN_ROUND if state.state == p.OPEN else Act.IN_CLOSED_ROUND)


# ---- newcomers: room in a closed plan --------------------------------------------
def has_room(plan: p.Plan, nproc: int, max_nodes: int, max_workers: int) -> bool:
    """Could a node of `nproc` workers join `plan` within --max-nodes/--max-workers?"""
    fits_workers = not max_workers or plan.world_size + nproc <= max_workers
    return len(plan.members) < max_nodes and fits_workers


# A standby node of a full run looks again this often; a member leaving opens a round.
STANDBY_WAIT_S = 1.0


def outsider_action(room: bool, own_wait: float, node_id: str) -> Action:
    """What node `node_id`, outside a closed plan, does: stand by, wait, or open a round.

    `own_wait`: newcomer_wait on this node's clock. The plan's first
    member usually opens the round sooner (newcomers.py); this is the backup.
    The round it opens names it (`round_opener`).
    """
    if not room:
        return Action(Act.WAIT, wait_s=STANDBY_WAIT_S)
    if own_wait > 0:
        return Action(Act.WAIT, wait_s=own_wait)
    return Action(Act.OPEN_NEXT, p.Cause.newcomer(node_id))


def round_opener(cause: p.Cause) -> frozenset[str]:
    """The outsider that opened a round itself, if one did.

    A node left out on suspicion that is alive opens its own round (nobody else
    does: see the module docstring); until it joins, every deputy still counts it
    among the `suspects`, which no round waits for. Opening and joining are two
    writes, so the members could join and close that very round in between, and
    the node would open yet another one (seen on a loaded 2-core CI machine: a
    round of the same two members, then the third). The opener has just shown it
    is alive: its own round waits for it like any live newcomer.
    """
    if cause.kind is p.CauseKind.NEWCOMER and cause.detail:
        return frozenset((cause.detail,))
    return frozenset()


# ---- waits, on the deciding agent's own clock (protocol.py says why) -------------
def settle_remaining(now: float, min_met_at: float, last_arrival_at: float,
                     settle_s: float, settle_max_s: float, live_unjoined: bool = False) -> float:
    """Seconds before a round that met its minimum at `min_met_at` may close.

    The round waits for `settle_s` of quiet after the later of the minimum being
    met and the newest registration, and while a registered (so live) node has
    not joined yet: it is on its way, and closing without it costs everyone
    another round. Never past `settle_max_s` after the minimum was met: a steady
    trickle of arrivals, or a node that never joins, must not hold it open forever.
    All times are on the deciding agent's own clock (`last_arrival_at`: when it
    saw the newest registration).
    """
    cap = min_met_at + settle_max_s
    if live_unjoined:
        return cap - now
    return min(max(min_met_at, last_arrival_at) + settle_s, cap) - now


def newcomer_wait(now: float, registered_at: float, others_registered_at: list[float],
                  settle_s: float, settle_max_s: float) -> float:
    """Seconds a node outside a closed plan waits before opening the next round.

    All times are the deciding agent's own clock: when it saw each registration.
    `others_registered_at` are those of every other live node, members included.
    When none registered within `settle_s`, it opens at once (a lone newcomer pays
    no wait); during a burst it waits for that much quiet, so the burst's first
    arrival costs one round and all later ones a second, bounded by
    `settle_max_s` after its own registration.
    """
    if not others_registered_at:
        return 0.0
    return max(0.0, min(max(others_registered_at) + settle_s,
                        registered_at + settle_max_s) - now)


def members_open_wait(now: float, registered_at: dict[str, float], waiting: list[str],
                      settle_s: float, settle_max_s: float) -> float | None:
    """Seconds before a member opens the next round for `waiting` newcomers (None: none wait).

    The newcomer rule (`newcomer_wait`) evaluated for each waiting node by a member
    that saw them all arrive; the first to come due decides. `registered_at` holds
    every live node's registration time on the member's clock. O(nodes): the newest
    registration other than a node's own is the newest or the second newest.
    """
    if not waiting:
        return None
    newest = heapq.nlargest(2, registered_at.items(), key=lambda item: item[1])
    waits = []
    for node in waiting:
        others = [at for other, at in newest if other != node][:1]
        waits.append(newcomer_wait(now, registered_at.get(node, now), others,
                                   settle_s, settle_max_s))
    return min(waits)


# ---- an open round: may it close, and who closes it ------------------------------
def minimum_met(joined: int, workers: int, rules: RoundRules) -> bool:
    return joined >= rules.min_nodes and workers >= rules.min_workers


@dataclass(frozen=True)
class RoundLook:
    """An open round as one agent's copy shows it; times on that agent's clock."""

    joined: frozenset[str]
    workers: int
    registered: Mapping[str, float]  # live node -> when this agent first saw its key
    previous: tuple[str, ...] | None  # the previous plan's members (None: round 0)
    min_met_at: float | None
    opened_at: float
    deadline: float
    # The round was opened for a suspected member (CauseKind.MEMBER_SUSPECTED).
    suspected: bool = False
    # Live keys of nodes an earlier round left out on suspicion, not joined since.
    suspects: frozenset[str] = frozenset()


def suspect_left_out(look: RoundLook, now: float, rules: RoundRules) -> frozenset[str]:
    """Nodes a round no longer waits for: in any round, those an earlier round left
    out on suspicion (`suspects`) that have not joined; in a suspected round, also
    every member of the previous plan that has not joined, live key or not, once
    --suspect-grace has passed since the round opened (on this agent's clock): a
    node SIGKILLed a moment ago keeps its key until its lease expires, which is the
    wait suspicion exists to skip.
    """
    stale = look.suspects - look.joined
    if not look.suspected or look.previous is None or \
            now < look.opened_at + rules.suspect_grace_s:
        return stale
    return (frozenset(look.previous) - look.joined) | stale


def close_inputs(look: RoundLook, now: float,
                 rules: RoundRules) -> tuple[p.CloseInputs, tuple[float, ...]]:
    """protocol.may_close's inputs, and the timers after which they may differ.

    In a suspected round, members left out after the grace (`suspect_left_out`)
    count as gone: neither live, nor unjoined, nor draining.
    """
    left_out = suspect_left_out(look, now, rules)
    registered = {node: at for node, at in look.registered.items() if node not in left_out}
    live = set(registered)
    min_met = look.min_met_at
    settle_left = None if min_met is None else settle_remaining(
        now, min_met, max(registered.values(), default=min_met), rules.settle_s,
        rules.settle_max_s, live_unjoined=not live <= look.joined)
    drain_left = look.opened_at + rules.drain_timeout_s - now
    previous = look.previous
    grace_left = None
    if look.suspected and previous is not None and (set(previous) & live) - look.joined:
        grace_left = look.opened_at + rules.suspect_grace_s - now
    inputs = p.CloseInputs(
        joined=len(look.joined), min_nodes=rules.min_nodes, max_nodes=rules.max_nodes,
        workers=look.workers, min_workers=rules.min_workers, max_workers=rules.max_workers,
        all_live_joined=live <= look.joined,
        first_round=previous is None,
        settle_elapsed=settle_left is not None and settle_left <= 0,
        members_draining=previous is not None and bool((set(previous) & live) - look.joined)
        and drain_left > 0,
    )
    timers = tuple(w for w in (look.deadline - now, drain_left, settle_left, grace_left)
                   if w is not None)
    return inputs, timers


def left_out_on_suspicion(plan: p.Plan, previous: p.Plan | None) -> frozenset[str]:
    """Members of `previous` that `plan`, closed for a suspicion, left out.

    The plan's first member does not open a round for them while their keys live
    on (they are most likely dead: one that is alive opens the round itself).
    """
    if previous is None or p.Cause.parse(plan.cause).kind is not p.CauseKind.MEMBER_SUSPECTED:
        return frozenset()
    return frozenset(previous.node_ids) - set(plan.node_ids)


def elect_closer(joins: Iterable[tuple[str, int]]) -> str:
    """The node that closes a round: of (node id, join revision), the first to join.

    Revisions of distinct keys differ, so every agent elects the same node
    whatever order its copy lists the joins in; the id only breaks a tie no
    etcd produces.
    """
    return min(joins, key=lambda join: (join[1], join[0]))[0]


def closer_wait(me: str, closer: str, closable_since: float, now: float,
                settle_s: float) -> float:
    """Seconds before `me` may close a closable round (<= 0: now).

    Only one transaction can close a round; with every agent trying at once, a
    thousand agents sent a thousand doomed transactions per round. The elected
    closer goes at once, the others step in after --settle (a dead closer loses
    its join key with its lease, and the next joiner is elected).
    """
    return 0.0 if me == closer else closable_since + settle_s - now


class CloseStep(enum.Enum):
    WAIT = "wait as a backup closer"
    VERIFY_COPY = "check the copy against etcd's counts, then close"
    CLOSE = "close now"


def close_step(backup_wait: float, joined: int, max_nodes: int) -> CloseStep:
    """How a closable round is closed by this agent.

    A round at --max-nodes cannot be missing a joiner, so only a smaller one is
    worth two count reads before the close transaction (which guards the round
    key only: a lagging copy would leave out nodes that joined moments ago).
    """
    if backup_wait > 0:
        return CloseStep.WAIT
    return CloseStep.CLOSE if joined >= max_nodes else CloseStep.VERIFY_COPY


@dataclass(frozen=True)
class LastLook:
    """What an agent's last full evaluation of an open round saw (counts, not keys)."""

    number: int
    joined: int
    departures: int
    min_met: bool
    recheck_at: float


def wait_without_looking(last: LastLook | None, number: int, joined: int, live: int,
                         departures: int, now: float, rules: RoundRules,
                         suspects: int = 0) -> float | None:
    """Seconds to wait on when nothing since `last` can close the round (None: look).

    While hundreds of nodes join, every join wakes every agent; re-reading all
    joiners each time made a round cost O(N^3) work in all. Counts rule most
    wake-ups out: the round can only close once the joiners reach the live nodes
    or --max-nodes, when a node leaves, when the minimum is first met (or
    --max-workers may be reached), or when a timer runs out. `suspects`: live keys
    of nodes an earlier round left out on suspicion, which no round waits for
    (`suspect_left_out`); counted among the live nodes, they kept the joiners from
    ever reaching them, and a round a newcomer opened just after a suspicion waited
    for the drain timeout or the suspect's lease.
    """
    if last is None or last.number != number:
        return None
    left = last.recheck_at - now
    if left <= 0 or departures != last.departures or joined >= live - suspects or \
            joined >= rules.max_nodes:
        return None
    if joined != last.joined and (not last.min_met or rules.max_workers):
        return None
    return min(left, 1.0)


# ---- closing: the restart budget -------------------------------------------------
@dataclass(frozen=True)
class RestartVerdict:
    restart_count: int  # what the new plan carries
    exhausted: bool  # True: fail the job instead of closing


def restart_verdict(previous: p.Plan | None, failed: bool, members: tuple[str, ...],
                    max_restarts: int) -> RestartVerdict:
    """The restart count of a round closing with `members` after `previous`.

    `failed`: a worker of the previous round reported a failure. Members lost or
    left excuse it (protocol.counts_as_restart): the crash followed from them.
    """
    count = previous.restart_count if previous else 0
    if previous is None or not p.counts_as_restart(failed, previous.node_ids, members):
        return RestartVerdict(count, False)
    return RestartVerdict(count + 1, count + 1 > max_restarts)


# ---- while workers run: does the plan still hold ---------------------------------
def suspicion_opens(state: p.RoundState | None, plan_round: int) -> bool:
    """Does a suspicion about the plan of `plan_round` open the next round?

    Only while that plan's round is the closed current one: once a later round
    opened (another survivor's suspicion, a loss, a newcomer) there is nothing to
    do, everyone joins that one; a finished or failed run opens nothing.
    """
    return state is not None and state.number == plan_round and state.state == p.CLOSED


class Watch(enum.Enum):
    HOLDS = "the run finished: nothing left to watch"
    MEMBERS = "the round key says nothing: look at members and newcomers"


def plan_change(plan_round: int, state: p.RoundState | None,
                lease_lost: bool) -> p.Cause | Watch:
    """Why the plan of `plan_round` stopped holding, judged by the round key and our lease."""
    if lease_lost:
        return p.Cause(p.CauseKind.LEASE_EXPIRED)
    if state is None:
        return p.Cause(p.CauseKind.OTHER, "round key deleted")
    if state.number > plan_round:
        return p.Cause.parse(state.cause)
    if state.state == p.FAILED:
        return p.Cause(p.CauseKind.JOB_FAILED)
    return Watch.HOLDS if state.state == p.FINISHED else Watch.MEMBERS


def lost_members(plan: p.Plan, live: Iterable[str]) -> tuple[str, ...]:
    """Members of `plan` not among `live` (those whose join of its round lives on),
    in plan order."""
    alive = set(live)
    return tuple(node for node in plan.node_ids if node not in alive)


def newcomers_wait_after(plan_round: int, state: p.RoundState | None) -> bool:
    """Is the round after `plan_round` open for newcomers only (so far)?

    Its members go on forming or training (a newcomer is taken in at a step
    boundary), which is right only while every member of the plan is alive.
    """
    return (state is not None and state.number == plan_round + 1 and state.state == p.OPEN
            and p.Cause.parse(state.cause).kind is p.CauseKind.NEWCOMER)


def gone_since_plan(members: Iterable[str], created: Mapping[str, int],
                    plan_created: int) -> tuple[str, ...]:
    """Those of a plan's `members` whose node key is gone or younger than the plan,
    in the order given.

    `created`: each member's node key create revision (0 or absent: no key);
    `plan_created`: the plan key's. Every member registered before it joined the
    plan's round, so a key created after the plan is a new agent under the id
    (the one the plan holds lost its lease: a stall just past --lease-ttl, a
    supervisor's restart). Asked while the next round is open, when the members'
    joins of the plan's round are no guide: each goes as its member joins anew.
    """
    return tuple(node for node in members
                 if not created.get(node) or created[node] > plan_created)
