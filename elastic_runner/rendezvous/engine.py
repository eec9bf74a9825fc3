"""EtcdRendezvous: the protocol rules driven on etcd for one node.

Liveness is the lease (a node's keys vanish when it dies or leaves), changes
arrive through one watch (a PrefixMirror), and every write that decides
something is a transaction: joining compares the round's mod revision, so nobody
joins a round after it closed; closing compares it too and writes the plan and
the closed state together, so racing closers agree on one plan.

Clocks are injected (`clock`: monotonic, for every decision; `wall_clock`: only
for records people read) so a test can run agents whose clocks disagree, as
those of different machines do. No decision compares a time written by another
agent: "quiet for S seconds" is measured from when this agent saw the event.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from elastic_runner.config import RendezvousConfig
from elastic_runner.errors import (
    RendezvousTimeout, RunFinished, ShutdownRequested, WorkerFailure,
)
from elastic_runner.etcd.client import EtcdClient, Put, key_missing, mod_revision_is
from elastic_runner.etcd.lease import KeptLease
from elastic_runner.etcd.mirror import PrefixMirror
from elastic_runner.etcd.server import free_port
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous import registration
from elastic_runner.rendezvous.failures import failure_message
from elastic_runner.rendezvous.newcomers import Newcomers

log = logging.getLogger(__name__)

EVENT_TTL_S = 24 * 3600
# After a wake-up, let further watch events land before re-evaluating: one
# evaluation reads every joiner, so evaluating per event costs O(N^2) per agent
# per round. The window grows with the number of nodes and stays far below a
# process restart.
BATCH_S_PER_NODE = 0.0001
MAX_BATCH_S = 0.05
# A copy of etcd whose counts still disagree after this long is read again.
RESYNC_AFTER_S = 5.0


@dataclass(frozen=True)
class RoundView:
    state: p.RoundState
    mod_revision: int


@dataclass(frozen=True)
class _OpenRoundLook:
    """What the last full evaluation of an open round saw (counts, not keys)."""

    number: int
    joined: int
    departures: int
    min_met: bool
    recheck_at: float


class EtcdRendezvous:
    def __init__(self, client: EtcdClient, config: RendezvousConfig, spec: p.JobSpec,
                 max_restarts: int, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self._client = client
        self._config = config
        self._spec = spec
        self._max_restarts = max_restarts
        self._clock = clock
        self._wall_clock = wall_clock
        self.prefix = config.prefix
        self.node_id = config.node_id
        self.mirror = PrefixMirror(client, self.prefix, ignore=p.is_passive_key, clock=clock)
        self.newcomers = Newcomers(self.mirror, config, clock)
        self.lease: KeptLease | None = None
        self.shutdown = threading.Event()
        self._min_met_at: dict[int, float] = {}
        self._opened_at: dict[int, float] = {}
        # Parsed values by key, valid while the key's mod revision is unchanged.
        self._decoded: dict[str, tuple[int, object]] = {}
        self._newest_round_seen = -1
        self._last_look: _OpenRoundLook | None = None
        self._first_joiner: dict[int, str] = {}
        self._closable_since: dict[int, float] = {}
        self._lagging_since: dict[int, float] = {}
        self._members_checked: tuple[int, int] | None = None

    # ---- membership -------------------------------------------------------------
    def register(self) -> None:
        """Check the job spec, take a lease and announce this node.

        Raises:
            SpecMismatch / SchemaMismatch: the run id belongs to another job.
            DuplicateNodeId: a live agent of this run already uses our --node-id.
        """
        registration.check_spec(self._client, self._config, self._spec)
        self.mirror.start()
        try:
            self._take_lease()
        except BaseException:
            self.mirror.stop()
            raise

    def _take_lease(self) -> None:
        """Create our node key under a fresh lease (registration.py: never over another's)."""
        record = registration.node_record(self._config, self._wall_clock)
        self.lease = registration.take_lease(self._client, self._config, self.mirror, record,
                                             on_lost=self.mirror.wake)

    def leave(self) -> None:
        """Revoke the lease so the others re-form now rather than after the TTL."""
        if self.lease is not None:
            self.lease.revoke()
        self.mirror.stop()

    def ping(self) -> None:
        """One cheap request: raises EtcdUnavailable while etcd does not answer."""
        self._client.server_version()

    # ---- what the agent may use besides rounds ----------------------------------
    # The agent waits, interrupts and asks how long etcd has been silent; it never
    # touches the mirror or the lease, so either can change without the agent noticing.
    def change_marker(self) -> int:
        """A token for wait_for_change: read it before looking, wait after."""
        return self.mirror.generation

    def wait_for_change(self, timeout_s: float, since: int) -> bool:
        """Sleep until etcd changed (or wake() was called) after `since`, or the timeout."""
        return self.mirror.wait(timeout_s, since)

    def wake(self) -> None:
        """Make a waiter look again now (a cloud notice, a signal)."""
        self.mirror.wake()

    def interrupt(self) -> None:
        """Stop waiting for rounds: next_plan raises ShutdownRequested."""
        self.shutdown.set()
        self.mirror.wake()

    def seconds_since_etcd_answered(self) -> float:
        """How long the lease keep-alive has gone unanswered (0 before registering)."""
        return self.lease.seconds_since_refresh() if self.lease is not None else 0.0

    # ---- reading the mirror -----------------------------------------------------
    def current_round(self) -> RoundView | None:
        kv = self.mirror.get(p.round_key(self.prefix))
        return RoundView(p.RoundState.from_json(kv.value), kv.mod_revision) if kv else None

    def plan(self, number: int) -> p.Plan | None:
        kv = self.mirror.get(p.plan_key(self.prefix, number))
        return self._decode(kv, lambda kv: p.Plan.from_json(kv.value)) if kv else None

    def _joiners(self, number: int) -> list[p.Joiner]:
        return [self._decode(kv, lambda kv: p.Joiner.from_json(kv.value, kv.create_revision))
                for kv in self.mirror.children(p.join_prefix(self.prefix, number))]

    def _live_nodes(self) -> set[str]:
        return {p.node_id_from_key(kv.key)
                for kv in self.mirror.children(p.nodes_prefix(self.prefix))}

    def _decode(self, kv, parse):
        cached = self._decoded.get(kv.key)
        if cached is not None and cached[0] == kv.mod_revision:
            return cached[1]
        value = parse(kv)
        self._decoded[kv.key] = (kv.mod_revision, value)
        return value

    def _forget_rounds_before(self, number: int) -> None:
        """Drop parsed joins of rounds that can no longer matter (memory stays O(N))."""
        stale = [key for key in self._decoded if key.startswith(self.prefix)
                 and (p.round_of(key[len(self.prefix):]) or number) < number - 1]
        for key in stale:
            del self._decoded[key]
        for per_round in (self._min_met_at, self._opened_at, self._first_joiner,
                          self._closable_since, self._lagging_since):
            for old in [n for n in per_round if n < number - 1]:
                del per_round[old]

    # ---- transactions -----------------------------------------------------------
    def _cas_round(self, seen: RoundView | None, new: p.RoundState, *extra: Put) -> bool:
        guard = (mod_revision_is(p.round_key(self.prefix), seen.mod_revision) if seen
                 else key_missing(p.round_key(self.prefix)))
        result = self._client.txn([guard], [Put(p.round_key(self.prefix), new.to_json()), *extra])
        self.mirror.wait_revision(result.revision,
                                  timeout_s=self._config.write_visible_timeout_s)
        return result.succeeded

    def open_next(self, seen: RoundView, cause: str) -> bool:
        return self._cas_round(seen, p.RoundState(seen.state.number + 1, p.OPEN, cause))

    def _join(self, seen: RoundView) -> None:
        port = self._config.master_port or free_port(self._config.node_addr)
        joiner = p.Joiner(self.node_id, self._config.node_addr, port, self._config.nproc,
                          labels=self._config.labels)
        key = p.join_key(self.prefix, seen.state.number, self.node_id)
        result = self._client.txn([mod_revision_is(p.round_key(self.prefix), seen.mod_revision)],
                                  [Put(key, joiner.to_json(), self.lease.id)])
        self.mirror.wait_revision(result.revision,
                                  timeout_s=self._config.write_visible_timeout_s)

    def report_failure(self, number: int, failure: dict) -> None:
        """Record the first failure of a round: the one the job's error will name."""
        self._client.create_if_absent(p.failure_key(self.prefix, number),
                                      json.dumps(failure).encode())

    def publish_event(self, record: dict) -> None:
        """A copy of an event for `status`, expiring on its own after EVENT_TTL_S."""
        lease = self._client.grant_lease(EVENT_TTL_S)
        key = p.event_key(self.prefix, int(self._wall_clock() * 1e9), self.node_id)
        self._client.put(key, json.dumps(record, default=str).encode(), lease=lease)

    def give_notice(self, round_number: int) -> None:
        """Announce that this node is about to be reclaimed (bound to our lease)."""
        record = json.dumps({"round": round_number}).encode()
        self._client.put(p.notice_key(self.prefix, self.node_id), record, lease=self.lease.id)

    def notices(self, plan: p.Plan) -> list[str]:
        """Members of `plan` that announced their departure during its round."""
        found = []
        for kv in self.mirror.children(p.notice_prefix(self.prefix)):
            node = p.node_id_from_key(kv.key)
            if node in plan.node_ids and json.loads(kv.value).get("round") == plan.round:
                found.append(node)
        return found

    def finish(self, plan: p.Plan) -> None:
        seen = self.current_round()
        if seen and seen.state.number == plan.round and seen.state.state == p.CLOSED:
            self._cas_round(seen, p.RoundState(plan.round, p.FINISHED, "workers succeeded"))

    # ---- the round loop ---------------------------------------------------------
    def next_plan(self, previous: p.Plan | None, cause: str) -> p.Plan:
        """Block until a closed round includes this node; return its plan.

        Raises:
            RendezvousTimeout: fewer than --min-nodes joined within --join-timeout.
            RunFinished / WorkerFailure: the run ended while we waited.
            ShutdownRequested: `shutdown` was set (SIGTERM/SIGINT).
        """
        deadline = self._clock() + self._config.join_timeout_s
        while True:
            if self.shutdown.is_set():
                raise ShutdownRequested("shutdown requested during rendezvous")
            if self.lease.lost.is_set():
                self._take_lease()
            generation = self.mirror.generation
            outcome = self._step(previous, cause, deadline)
            if isinstance(outcome, p.Plan):
                return outcome
            if outcome is not None and self.mirror.wait(outcome, generation):
                live = self.mirror.census(p.nodes_prefix(self.prefix))[0]
                time.sleep(min(MAX_BATCH_S, BATCH_S_PER_NODE * live))

    def _step(self, previous: p.Plan | None, cause: str, deadline: float):
        """One evaluation: return a Plan, a wait in seconds, or None to re-evaluate now."""
        seen = self.current_round()
        if seen is None:
            self._cas_round(None, p.RoundState(0, p.OPEN, "start"))
            return None
        state = seen.state
        if state.state == p.FINISHED:
            raise RunFinished(f"run {self._config.run_id!r} already finished; "
                              "pass a new --run-id to start it again")
        if state.state == p.FAILED:
            raise WorkerFailure(state.detail)
        if previous is not None and state.number <= previous.round:
            self.open_next(seen, cause)
            return None
        if state.number > self._newest_round_seen:
            self._newest_round_seen = state.number
            self._forget_rounds_before(state.number)
        if state.state == p.OPEN:
            return self._in_open_round(seen, deadline)
        plan = self.plan(state.number)
        if plan is None:
            return 0.1  # our copy lags the closing transaction by a moment
        if plan.member(self.node_id):
            return plan
        if not self.newcomers.has_room(plan, self._config.nproc):
            return 1.0  # standby: the run is full; a leaving member opens a round
        wait = self.newcomers.own_wait()
        if wait > 0:
            return wait  # the plan's first member usually opens it sooner (newcomers.py)
        self.open_next(seen, "newcomer")
        return None

    def _in_open_round(self, seen: RoundView, deadline: float):
        number = seen.state.number
        if self.mirror.get(p.join_key(self.prefix, number, self.node_id)) is None:
            self._join(seen)
            return None
        wait = self._wait_without_looking(number)
        if wait is not None:
            return wait
        inputs, timers, previous = self._look_at_open_round(number, deadline)
        now = self._clock()
        if p.may_close(inputs):
            backup_left = self._backup_closer_wait(number, now)
            if backup_left > 0:
                timers.append(backup_left)
            elif inputs.joined < self._config.max_nodes and self._copy_lags(number):
                return 0.2
            else:
                self._close(seen, self._joiners(number), previous)
                return None
        waits = [w for w in timers if w > 0]
        self._last_look = _OpenRoundLook(
            number, inputs.joined, self.mirror.census(p.nodes_prefix(self.prefix))[1],
            number in self._min_met_at, now + min(waits, default=float("inf")))
        return min(waits + [1.0])

    def _look_at_open_round(self, number: int, deadline: float):
        """Read our copy once: the close rule's inputs and the timers that can change them."""
        joiner_kvs = self.mirror.children(p.join_prefix(self.prefix, number))
        joined = {p.node_id_from_key(kv.key) for kv in joiner_kvs}
        # Parsing every join record is only needed to count workers (and to close).
        workers = (sum(j.nproc for j in self._joiners(number))
                   if self._config.min_workers or self._config.max_workers else len(joined))
        now = self._clock()
        opened_at = self._opened_at.setdefault(number, now)
        if len(joined) >= self._config.min_nodes and workers >= self._config.min_workers:
            self._min_met_at.setdefault(number, now)
        elif now >= deadline:
            raise RendezvousTimeout(
                f"only {len(joined)} of --min-nodes {self._config.min_nodes} node(s) joined "
                f"run {self._config.run_id!r} within --join-timeout "
                f"{self._config.join_timeout_s:g} s; start more nodes or lower --min-nodes"
            )
        previous = self.plan(number - 1) if number > 0 else None
        registered = self.newcomers.registered()
        live = set(registered)
        self._first_joiner[number] = min(joiner_kvs, key=lambda kv: kv.create_revision).key
        min_met = self._min_met_at.get(number)
        settle_left = None if min_met is None else p.settle_remaining(
            now, min_met, max(registered.values(), default=min_met), self._config.settle_s,
            self._config.settle_max_s, live_unjoined=not live <= joined)
        drain_left = opened_at + self._config.drain_timeout_s - now
        inputs = p.CloseInputs(
            joined=len(joined), min_nodes=self._config.min_nodes,
            max_nodes=self._config.max_nodes, workers=workers,
            min_workers=self._config.min_workers, max_workers=self._config.max_workers,
            all_live_joined=live <= joined,
            first_round=previous is None,
            settle_elapsed=settle_left is not None and settle_left <= 0,
            members_draining=bool(previous) and bool(
                (set(previous.node_ids) & live) - joined) and drain_left > 0,
        )
        timers = [w for w in (deadline - now, drain_left, settle_left) if w is not None]
        return inputs, timers, previous

    def _backup_closer_wait(self, number: int, now: float) -> float:
        """Seconds before this agent may close a closable round; 0 for the first joiner.

        Only one transaction can close a round; with every agent trying at once, a
        thousand agents sent a thousand doomed transactions (and read etcd's counts
        a thousand times) per round. The round's first joiner closes it; the others
        step in after --settle in case it is slow or hung (a dead one loses its join
        key with its lease, and the next joiner becomes the first).
        """
        if self._first_joiner.get(number) == p.join_key(self.prefix, number, self.node_id):
            return 0.0
        closable_since = self._closable_since.setdefault(number, now)
        return closable_since + self._config.settle_s - now

    def _copy_lags(self, number: int) -> bool:
        """Before closing, check our copy against etcd's counts of joiners and nodes.

        The close transaction guards the round key only, so a closer whose watch
        lags (a busy host) would leave out nodes that joined moments ago, and
        they would open yet another round. Two count-only reads per close
        attempt; on a mismatch, evaluate again once the watch caught up.
        """
        directories = (p.join_prefix(self.prefix, number), p.nodes_prefix(self.prefix))
        in_etcd = [self._client.count_prefix(directory) for directory in directories]
        self._last_look = None
        if in_etcd == [self.mirror.census(directory)[0] for directory in directories]:
            self._lagging_since.pop(number, None)
            return False
        lagging_since = self._lagging_since.setdefault(number, self._clock())
        if self._clock() - lagging_since > RESYNC_AFTER_S:
            log.warning("our copy of etcd disagrees with it for %.0f s; reading it again",
                        RESYNC_AFTER_S)
            self.mirror.resync()
            self._lagging_since.pop(number, None)
        return True

    def _wait_without_looking(self, number: int) -> float | None:
        """Seconds to wait on when nothing since the last evaluation can close the round.

        While hundreds of nodes join, every join wakes every agent; re-reading all
        joiners each time made a round cost O(N^3) work in all. Counts rule most
        wake-ups out: the round can only close once the joiners reach the live
        nodes or --max-nodes, when a node leaves, when the minimum is first met
        (or --max-workers may be reached), or when a timer runs out.
        """
        look = self._last_look
        if look is None or look.number != number:
            return None
        joined, _ = self.mirror.census(p.join_prefix(self.prefix, number))
        live, departures = self.mirror.census(p.nodes_prefix(self.prefix))
        left = look.recheck_at - self._clock()
        if left <= 0 or departures != look.departures or joined >= live or \
                joined >= self._config.max_nodes:
            return None
        if joined != look.joined and (not look.min_met or self._config.max_workers):
            return None
        return min(left, 1.0)

    def _close(self, seen: RoundView, joiners: list[p.Joiner], previous: p.Plan | None) -> None:
        number = seen.state.number
        order = p.rank_order(previous.node_ids if previous else (), joiners,
                             self._config.rank0_prefer)
        plan = p.build_plan(number, order, self._config.max_nodes,
                            previous.restart_count if previous else 0, seen.state.cause,
                            self._config.max_workers)
        failure = self.mirror.get(p.failure_key(self.prefix, number - 1))
        if previous and p.counts_as_restart(failure is not None, previous.node_ids, plan.node_ids):
            plan = p.Plan(plan.round, plan.members, plan.master_addr, plan.master_port,
                          plan.restart_count + 1, plan.cause)
            if plan.restart_count > self._max_restarts:
                detail = failure_message(json.loads(failure.value), self._max_restarts)
                self._cas_round(seen, p.RoundState(number, p.FAILED, "worker-failure", detail))
                return
        self._cas_round(seen, p.RoundState(number, p.CLOSED, seen.state.cause),
                        Put(p.plan_key(self.prefix, number), plan.to_json()))

    # ---- while workers run ------------------------------------------------------
    def change_reason(self, plan: p.Plan) -> str | None:
        """Why the workers of `plan` must stop, or None while the plan still holds."""
        seen = self.current_round()
        if self.lease.lost.is_set():
            return "this node's lease expired"
        if seen is None or seen.state.number > plan.round:
            cause = seen.state.cause if seen else "round key deleted"
            return f"round {seen.state.number if seen else '?'} opened ({cause})"
        if seen.state.state == p.FAILED:
            return "the job failed"
        if seen.state.state == p.FINISHED:
            return None
        departures = self.mirror.census(p.nodes_prefix(self.prefix))[1]
        # Skipped while no node key was deleted since every member was seen live.
        if self._members_checked != (plan.round, departures):
            live = self._live_nodes()
            lost = [node for node in plan.node_ids if node not in live]
            if lost:
                lost = self._confirm_lost(lost)
            if lost:
                self.open_next(seen, f"member-lost: {','.join(lost)}")
                return f"member(s) lost: {', '.join(lost)}"
            self._members_checked = (plan.round, departures)
        return self._open_for_newcomers(seen, plan)

    def _open_for_newcomers(self, seen: RoundView, plan: p.Plan) -> str | None:
        """The plan's first member opens the next round once a newcomer is due.

        It saw the newcomers register, so it tells a lone arrival (at once) from
        a burst (after the settle quiet) on its own clock; see newcomers.py.
        """
        wait = self.newcomers.members_wait(plan)
        if wait is None or wait > 0 or not self.open_next(seen, "newcomer"):
            return None
        return f"round {plan.round + 1} opened (newcomer)"

    def _confirm_lost(self, lost: list[str]) -> list[str]:
        """Members our copy misses that etcd still has mean the copy is wrong: re-read it.

        One read per suspected loss (rare): tearing down a running job because a
        watch dropped events would cost every node a restart.
        """
        kvs, _ = self._client.get_prefix(p.nodes_prefix(self.prefix))
        registered = {p.node_id_from_key(kv.key) for kv in kvs}
        if not registered & set(lost):
            return lost
        log.warning("our copy of etcd missed %d live node(s); reading it again",
                    len(registered & set(lost)))
        self.mirror.resync()
        self._last_look = None
        return [node for node in lost if node not in registered]

