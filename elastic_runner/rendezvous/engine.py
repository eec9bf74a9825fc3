"""EtcdRendezvous: the protocol rules driven on etcd for one node.

Liveness is the lease (a node's keys vanish when it dies or leaves), changes
arrive through one watch (a PrefixMirror), and every write that decides
something is a transaction: joining compares the round's mod revision, so nobody
joins a round after it closed; closing compares it too and writes the plan and
the closed state together, so racing closers agree on one plan.

This module only reads (its copy of etcd), asks, and writes: what to do next is
decided by pure functions (decisions.py, on protocol.py's rules) from plain
values read here and the time, so those decisions are tested without etcd.

Clocks are injected (`clock`: monotonic, for every decision; `wall_clock`: only
for records people read) so a test can run agents whose clocks disagree, as
those of different machines do. No decision compares a time written by another
agent: "quiet for S seconds" is measured from when this agent saw the event.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Callable

from elastic_runner.config import RendezvousConfig
from elastic_runner.errors import (
    LeaseLost, LeaseNotFound, RendezvousTimeout, RunFinished, ShutdownRequested, WorkerFailure,
)
from elastic_runner.etcd.client import (Delete, EtcdClient, KeyValue, Put, TxnResult,
                                       key_missing, mod_revision_is)
from elastic_runner.etcd.lease import KeptLease
from elastic_runner.etcd.mirror import PrefixMirror
from elastic_runner.etcd.server import EVERY_INTERFACE, free_port
from elastic_runner.rendezvous import decisions as d
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous import carried_plan, old_rounds, ranks, registration
from elastic_runner.rendezvous.deputies import Deputies
from elastic_runner.rendezvous.event_copy import EventCopy
from elastic_runner.rendezvous.failures import failure_message
from elastic_runner.rendezvous.newcomers import Newcomers
from elastic_runner.rendezvous.running import RoundView, WhileRunning

log = logging.getLogger(__name__)

# After a wake-up, let further watch events land before re-evaluating: one evaluation
# reads every joiner, so one per event costs O(N^2) per agent per round. The window
# grows with the number of nodes and stays far below a process restart.
BATCH_S_PER_NODE = 0.0001
MAX_BATCH_S = 0.05
# A copy of etcd whose counts still disagree after this long is read again.
RESYNC_AFTER_S = 5.0
# The longest a non-deputy in an open round sleeps between looks (a change of the
# round key or of the deputies wakes it sooner).
FOLLOWER_LOOK_S = 5.0
WRITE_PROBE_TTL_S = 5  # ping(write=True): a full etcd refuses lease grants (3.4, 3.5)


class EtcdRendezvous(WhileRunning):
    def __init__(self, client: EtcdClient, config: RendezvousConfig, spec: p.JobSpec,
                 max_restarts: int, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self._client, self._config, self._spec = client, config, spec
        self._clock, self._wall_clock, self._max_restarts = clock, wall_clock, max_restarts
        self.prefix, self.node_id = config.prefix, config.node_id
        self._rules = d.RoundRules(config.min_nodes, config.max_nodes, config.min_workers,
                                   config.max_workers, config.settle_s, config.settle_max_s,
                                   config.drain_timeout_s, config.suspect_grace_s)
        self.mirror = PrefixMirror(client, self.prefix, ignore=p.is_passive_key, clock=clock,
                                   narrow=p.shared_range(self.prefix))
        self.deputies = Deputies(client, self.mirror, self.prefix, self.node_id,
                                 config.deputies, config.write_visible_timeout_s,
                                 lease_gone=lambda why: self.lease.mark_lost(why))
        self.newcomers = Newcomers(self.mirror, config, clock, opener=self.deputies.opener)
        self.event_copy = EventCopy(client, self.prefix, self.node_id, clock, wall_clock)
        self.lease: KeptLease | None = None
        self.shutdown = threading.Event()
        self._min_met_at: dict[int, float] = {}
        self._opened_at: dict[int, float] = {}
        # Parsed values by key, valid while the key's mod revision is unchanged.
        self._decoded: dict[str, tuple[int, object]] = {}
        self._newest_round_seen = -1
        self._last_look: d.LastLook | None = None
        self._closable_since: dict[int, float] = {}
        self._lagging_since: dict[int, float] = {}
        self._members_checked: tuple | None = None  # running.py: what was last found whole
        # (round, lease) of our last join: a non-deputy's copy holds no join keys.
        self._joined: tuple[int, int] | None = None
        self._registered_at = clock()
        self._marked_in_place = False
        self._quiet_at: tuple[int, int] | None = None  # running.py: change_reason

    # ---- membership -------------------------------------------------------------
    def register(self, unless_in_place: bool = False) -> bool:
        """Check the job spec, take a lease and announce this node; True once announced.

        `unless_in_place`: where the run's workers re-form in place, announce nothing
        and return False (the lease is kept): the agent starts its workers on standby
        and calls register() again (agent/standby.py).

        Raises:
            SpecMismatch / SchemaMismatch: the run id belongs to another job.
            DuplicateNodeId: a live agent of this run already uses our --node-id.
        """
        snapshot = self._take_lease(starting=True, unless_in_place=unless_in_place)
        if snapshot is registration.STAND_BY:
            return False
        try:
            self.mirror.start(snapshot)
            self.deputies.ensure(self.lease.id)
        except BaseException:
            self.leave()
            raise
        return True

    def _take_lease(self, starting: bool, unless_in_place: bool = False
                    ) -> tuple[tuple[KeyValue, ...], int] | TxnResult | None:
        """Create our node key under a fresh lease (registration.py: never over another's),
        at a start after checking the job spec (or the lease kept while standing by).

        The same transaction opens the first round where there is none yet, takes a
        free deputy slot, and at a start joins that first round and reads the range
        our copy starts from: one request per agent instead of up to six, and none
        racing to create what an earlier one had (round 0, the slots). Returns that
        read and its revision, when there is one (STAND_BY: registration.py).
        """
        def also(lease_id: int) -> list:
            joiner = self._joiner().to_json() if starting else None
            return registration.with_node_key(self.prefix, self.node_id, lease_id,
                                              self.deputies.claim_ops(lease_id), joiner)
        record = registration.node_record(self._config, self._wall_clock)
        held = self.lease if starting and self.lease and not self.lease.lost.is_set() else None
        self.lease, created = registration.take_lease(
            self._client, self._config, record, on_lost=self.mirror.wake, also=also,
            spec=self._spec if starting else None, held=held, unless_in_place=unless_in_place)
        self._registered_at = self._clock()
        if created is registration.STAND_BY:
            return created
        if created is None or not starting:
            return None
        joined, shared = created.reads
        if joined.kvs:
            self._joined = (0, self.lease.id)
        return shared.kvs, created.revision

    def leave(self) -> None:
        """Revoke the lease so the others re-form now rather than after the TTL."""
        if self.lease is not None:
            self.lease.revoke()
        self.mirror.stop()

    def origin(self) -> str:
        """Which launch of the run id this is (for checkpoint manifests): our copy has it."""
        return registration.run_origin(self._client, self.prefix,
                                       self.mirror.get(p.origin_key(self.prefix)))

    def ping(self, write: bool = False) -> None:
        """One cheap request: raises EtcdUnavailable while etcd does not answer. With
        `write`, a lease granted and revoked (no key): EtcdFull while etcd is full."""
        if write:
            self._client.revoke_lease(self._client.grant_lease(WRITE_PROBE_TTL_S))
        else:
            self._client.server_version()

    # ---- reading the mirror -----------------------------------------------------
    def current_round(self) -> RoundView | None:
        """Parsed once per change: every agent asks on every monitor tick."""
        kv = self.mirror.get(p.round_key(self.prefix))
        return self._decode(kv, lambda kv: RoundView(p.RoundState.from_json(kv.value),
                                                     kv.mod_revision)) if kv else None

    def plan(self, number: int) -> p.Plan | None:
        """A round's plan: from our copy when it is wide; else from the closed round key
        (carried_plan.py: as an edit of the previous plan, which a member holds); else
        read once from etcd (written with its round's close, never changed)."""
        key = p.plan_key(self.prefix, number)
        if self.mirror.wide:
            kv = self.mirror.get(key)
            return self._decode(kv, lambda kv: p.plan_from(kv.value)) if kv else None
        if key not in self._decoded:
            round_kv = self.mirror.get(p.round_key(self.prefix))
            held = {v.round: v for _, v in self._decoded.values() if isinstance(v, p.Plan)}
            carried = carried_plan.carried(round_kv.value, held) if round_kv else None
            if carried is None or carried.round != number:
                kv = self._client.get(key)
                carried = p.plan_from(kv.value) if kv else None
            if carried is None:
                return None
            self._decoded[key] = (0, carried)
        return self._decoded[key][1]

    def _joiners(self, number: int) -> list[p.Joiner]:
        return [self._decode(kv, lambda kv: p.Joiner.from_json(kv.value, kv.create_revision))
                for kv in self.mirror.children(p.join_prefix(self.prefix, number))]

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
        for per_round in (self._min_met_at, self._opened_at, self._closable_since,
                          self._lagging_since):
            for old in [n for n in per_round if n < number - 1]:
                del per_round[old]

    # ---- transactions -----------------------------------------------------------
    def _cas_round(self, seen: RoundView | None, new: p.RoundState, *extra: Put,
                   plan: p.Plan | None = None, previous: p.Plan | None = None) -> bool:
        guard = (mod_revision_is(p.round_key(self.prefix), seen.mod_revision) if seen
                 else key_missing(p.round_key(self.prefix)))
        value = carried_plan.round_value(new, plan, previous)
        result = self._client.txn([guard], [Put(p.round_key(self.prefix), value), *extra])
        self._see_round_move(seen, result.revision)
        return result.succeeded

    def _see_round_move(self, seen: RoundView | None, revision: int) -> None:
        """Wait until our copy shows the round key past `seen` (our write, or the one
        that beat it). A narrow copy waits for that key: its revision moves only with
        the keys it holds, so `revision`, etcd's newest, may never reach it."""
        timeout_s = self._config.write_visible_timeout_s
        if self.mirror.wide:
            self.mirror.wait_revision(revision, timeout_s=timeout_s)
            return
        key, before = p.round_key(self.prefix), seen.mod_revision if seen else None
        self.mirror.wait_until(lambda: getattr(self.mirror.get(key), "mod_revision", None)
                               not in (None, before), timeout_s)

    def open_next(self, seen: RoundView, cause: p.Cause) -> bool:
        return self._cas_round(seen, p.RoundState(seen.state.number + 1, p.OPEN, cause.text()))

    def suspect(self, plan: p.Plan, cause: p.Cause) -> None:
        """Open the round after `plan` now: a survivor's collective failed (issue 15).

        `cause` (CauseKind.MEMBER_SUSPECTED, saying who saw what) is what the round
        records; a member of `plan` that does not join it within --suspect-grace is
        left out (decisions.suspect_left_out), so nobody waits for a dead node's
        lease. The same compare-and-swap as open_next; when another agent opened
        a later round first (or the run ended), there is nothing to do. Every
        agent, this one too, then joins the open round through next_plan.
        """
        if cause.kind is not p.CauseKind.MEMBER_SUSPECTED:
            raise ValueError(f"suspect() records a {p.CauseKind.MEMBER_SUSPECTED.value} "
                             f"cause, not {cause.kind.value!r}")
        for _ in range(3):  # a lost race re-reads: the winner's write ends it
            seen = self.current_round()
            if not d.suspicion_opens(seen.state if seen else None, plan.round) or \
                    self.open_next(seen, cause):
                return

    def _joiner(self) -> p.Joiner:
        # Rank 0's TCPStore listens on every interface; node_addr (dialled) may be NAT'd.
        port = self._config.master_port or free_port(EVERY_INTERFACE)
        return p.Joiner(self.node_id, self._config.node_addr, port, self._config.nproc,
                        labels=self._config.labels)

    def _join(self, seen: RoundView) -> None:
        """Join the open round; the same write deletes our join of an earlier round:
        under a lease as long as the node's, every round's N joins stayed, and etcd
        and each deputy's copy grew with rounds x N. Only an open round's joins are
        read (a closed one's plan holds its members); the deputies' one more event
        per agent per round costs etcd microseconds (bench/README)."""
        key = p.join_key(self.prefix, seen.state.number, self.node_id)
        ops = [Put(key, self._joiner().to_json(), self.lease.id)]
        if self._joined and self._joined[1] == self.lease.id and \
                self._joined[0] < seen.state.number:
            ops.append(Delete(p.join_key(self.prefix, self._joined[0], self.node_id)))
        try:
            result = self._client.txn(
                [mod_revision_is(p.round_key(self.prefix), seen.mod_revision)], ops)
        except LeaseNotFound as exc:  # starved past the TTL: register again (next_plan)
            self.lease.mark_lost(f"etcd refused our join ({exc})")
            return
        if result.succeeded:
            self._joined = (seen.state.number, self.lease.id)
        if self.mirror.wide:
            self.mirror.wait_revision(result.revision,
                                      timeout_s=self._config.write_visible_timeout_s)
        elif not result.succeeded:  # the round moved: look again once our copy shows it
            self._see_round_move(seen, result.revision)

    def _has_joined(self, number: int) -> bool:
        if self.mirror.wide:
            return self.mirror.get(p.join_key(self.prefix, number, self.node_id)) is not None
        return self._joined == (number, self.lease.id)

    # ---- the round loop ---------------------------------------------------------
    def next_plan(self, previous: p.Plan | None, cause: p.Cause,
                  rejoin: bool = True) -> p.Plan:
        """Block until a closed round includes this node; return its plan.

        `cause` is what a round opened by this node records. A node whose lease is
        found gone registers again with a new one, unless `rejoin` is False: then
        LeaseLost is raised, for a caller whose workers must leave their round first.

        Raises:
            RendezvousTimeout: fewer than --min-nodes joined within --join-timeout.
            RunFinished / WorkerFailure: the run ended while we waited.
            ShutdownRequested: `shutdown` was set (SIGTERM/SIGINT).
            LeaseLost: the lease is gone and `rejoin` is False.
        """
        deadline = self._clock() + self._config.join_timeout_s
        while True:
            if self.shutdown.is_set():
                raise ShutdownRequested("shutdown requested during rendezvous")
            if self.lease.lost.is_set():
                if not rejoin:
                    raise LeaseLost(f"node {self.node_id}'s lease is gone: the others "
                                    "re-formed without it")
                self._take_lease(starting=False)
                self.deputies.ensure(self.lease.id)
            generation = self.mirror.generation
            outcome = self._step(previous, cause, deadline)
            if isinstance(outcome, p.Plan):
                return outcome
            if outcome is not None and self.mirror.wait(outcome, generation):
                live = self.mirror.census(p.nodes_prefix(self.prefix))[0]
                time.sleep(min(MAX_BATCH_S, BATCH_S_PER_NODE * live))

    def _step(self, previous: p.Plan | None, cause: p.Cause, deadline: float):
        """One evaluation: return a Plan, a wait in seconds, or None to re-evaluate now."""
        seen = self.current_round()
        action = d.round_action(seen.state if seen else None,
                                previous.round if previous else None, cause)
        if action.act is d.Act.CREATE_FIRST:
            self._cas_round(None, p.first_round())
        elif action.act is d.Act.RUN_FINISHED:
            raise RunFinished(f"run {self._config.run_id!r} already finished; "
                              "pass a new --run-id to start it again")
        elif action.act is d.Act.RUN_FAILED:
            raise WorkerFailure(seen.state.detail)
        elif action.act is d.Act.OPEN_NEXT:
            self.open_next(seen, action.cause)
        else:
            if seen.state.number > self._newest_round_seen:
                self._newest_round_seen = seen.state.number
                self._forget_rounds_before(seen.state.number)
            if action.act is d.Act.IN_OPEN_ROUND:
                return self._in_open_round(seen, deadline)
            return self._in_closed_round(seen)
        return None

    def _in_closed_round(self, seen: RoundView):
        plan = self.plan(seen.state.number)
        if plan is None:
            return 0.1  # our copy lags the closing transaction by a moment
        if plan.member(self.node_id) and not self._has_joined(plan.round):
            # A new agent under a member's id (its old lease gone): that member is lost.
            self.open_next(seen, p.Cause.member_lost((self.node_id,)))
            return None
        if plan.member(self.node_id):
            if self.mirror.wide:  # only deputies decide on whom it left out
                self.newcomers.left_out.note(plan,
                                             self.plan(plan.round - 1) if plan.round else None)
            return plan
        if self.deputies.ensure(self.lease.id) and self._members_lost(seen, plan):
            return None  # a deputy outside the plan still sees a member go
        room = self.newcomers.has_room(plan, self._config.nproc)
        wait = self.newcomers.own_wait(self._registered_at) if room else 0.0
        action = d.outsider_action(room, wait, self.node_id)
        if action.act is d.Act.WAIT:
            return action.wait_s
        self.open_next(seen, action.cause)
        return None

    def _in_open_round(self, seen: RoundView, deadline: float):
        number = seen.state.number
        if not self._has_joined(number):
            self._join(seen)
            return None
        if not self.deputies.ensure(self.lease.id):
            return self._follower_wait(number, deadline)
        wait = self._wait_without_looking(number)
        if wait is not None:
            return wait
        look, previous, closer = self._look_at_open_round(seen, deadline)
        now = self._clock()
        inputs, timers = d.close_inputs(look, now, self._rules)
        waits = [w for w in timers if w > 0]
        if p.may_close(inputs):
            closable_since = (now if closer == self.node_id
                              else self._closable_since.setdefault(number, now))
            backup = d.closer_wait(self.node_id, closer, closable_since, now, self._config.settle_s)
            step = d.close_step(backup, inputs.joined, self._config.max_nodes)
            if step is d.CloseStep.WAIT:
                waits.append(backup)
            elif step is d.CloseStep.VERIFY_COPY and self._copy_lags(number):
                return 0.2
            else:
                self._close(seen, self._joiners(number), previous)
                return None
        self._last_look = d.LastLook(
            number, inputs.joined, self.mirror.census(p.nodes_prefix(self.prefix))[1],
            look.min_met_at is not None, now + min(waits, default=float("inf")))
        return min(waits + [1.0])

    def _look_at_open_round(self, seen: RoundView, deadline: float):
        """Read our copy once: the open round as values, its previous plan, its closer."""
        number = seen.state.number
        joins = self.mirror.children(p.join_prefix(self.prefix, number))
        joined = frozenset(p.node_id_from_key(kv.key) for kv in joins)
        # Parsing every join record is only needed to count workers (and to close).
        workers = (sum(j.nproc for j in self._joiners(number))
                   if self._config.min_workers or self._config.max_workers else len(joined))
        now = self._clock()
        opened_at = self._opened_at.setdefault(number, now)
        if d.minimum_met(len(joined), workers, self._rules):
            self._min_met_at.setdefault(number, now)
        elif now >= deadline:
            raise self._too_few(len(joined))
        previous = self.plan(number - 1) if number > 0 else None
        cause = p.Cause.parse(seen.state.cause)
        look = d.RoundLook(joined, workers, self.newcomers.registered(),
                           previous.node_ids if previous else None,
                           self._min_met_at.get(number), opened_at, deadline,
                           suspected=cause.kind is p.CauseKind.MEMBER_SUSPECTED,
                           suspects=self.newcomers.left_out.live() - d.round_opener(cause))
        deputies = self.deputies.holders()
        closer = d.elect_closer([(p.node_id_from_key(kv.key), kv.create_revision)
                                 for kv in joins if p.node_id_from_key(kv.key) in deputies]
                                or [(self.node_id, 0)])
        return look, previous, closer

    def _follower_wait(self, number: int, deadline: float) -> float:
        """A non-deputy waits for the round key (a deputy closes it); past --join-timeout
        it counts joins itself (workers taken as joins x its nproc: it has no join record)."""
        remaining = deadline - self._clock()
        if remaining > 0:
            return min(FOLLOWER_LOOK_S, remaining)
        joined = self._client.count_prefix(p.join_prefix(self.prefix, number))
        if d.minimum_met(joined, joined * self._config.nproc, self._rules):
            return FOLLOWER_LOOK_S  # the minimum is there: the deputies close the round
        raise self._too_few(joined)

    def _too_few(self, joined: int) -> RendezvousTimeout:
        return RendezvousTimeout(
            f"only {joined} of --min-nodes {self._config.min_nodes} node(s) joined "
            f"run {self._config.run_id!r} within --join-timeout "
            f"{self._config.join_timeout_s:g} s; start more nodes or lower --min-nodes")

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
        """Counts of our copy against the last look (decisions.wait_without_looking)."""
        joined, _ = self.mirror.census(p.join_prefix(self.prefix, number))
        live, departures = self.mirror.census(p.nodes_prefix(self.prefix))
        suspects = len(self.newcomers.left_out.live())
        return d.wait_without_looking(self._last_look, number, joined, live, departures,
                                      self._clock(), self._rules, suspects)

    def _close(self, seen: RoundView, joiners: list[p.Joiner], previous: p.Plan | None) -> None:
        """Write the plan, or fail the job when this round would exceed --max-restarts."""
        number = seen.state.number
        order = ranks.rank_order(previous.node_ids if previous else (), joiners,
                             self._config.rank0_prefer)
        plan = ranks.build_plan(number, order, self._config.max_nodes, 0, seen.state.cause,
                            self._config.max_workers)
        failure = self.mirror.get(p.failure_key(self.prefix, number - 1))
        verdict = d.restart_verdict(previous, failure is not None, plan.node_ids,
                                    self._max_restarts)
        if verdict.exhausted:
            detail = failure_message(json.loads(failure.value), self._max_restarts)
            cause = p.Cause(p.CauseKind.WORKER_FAILURE).text()
            self._cas_round(seen, p.RoundState(number, p.FAILED, cause, detail))
            return
        plan = dataclasses.replace(plan, restart_count=verdict.restart_count)
        self._cas_round(seen, p.RoundState(number, p.CLOSED, seen.state.cause),
                        Put(p.plan_key(self.prefix, number), plan.to_json()),
                        *old_rounds.superseded_by(self.prefix, number), plan=plan,
                        previous=previous)
