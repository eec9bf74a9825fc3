"""The half of EtcdRendezvous that serves a running plan (a mixin, split from
engine.py for size): whether the plan still holds, and the deputies' duties while
it runs (a member lost, newcomers due), the notices, the records besides rounds
(failures, events, the in-place mark) and the end of the run.

Why only deputies look at node keys here: every member checking every node key
each monitor tick needs every node key in every copy, N^2 events per round at a
thousand nodes (deputies.py); a member that is no deputy learns of a change from
the round key, which the deputy that saw it moves.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from elastic_runner.errors import EtcdError, EtcdUnavailable
from elastic_runner.etcd.client import Get, Put, mod_revision_is
from elastic_runner.etcd.values import MAX_TXN_OPS
from elastic_runner.rendezvous import decisions as d
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.failures import lost_a_peer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundView:
    """The round key as our copy holds it: its state and the revision a CAS compares."""

    state: p.RoundState
    mod_revision: int


class WhileRunning:
    """Uses the engine's copy, client, lease, deputies, newcomers and round transactions."""

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

    # ---- records besides rounds (failures, events, notices, the in-place mark) ---
    def report_failure(self, number: int, failure: dict) -> None:
        """Record the failure of a round that the job's error will name: the first one
        reported, unless it is a worker that died of a lost peer (failures.lost_a_peer)
        and this one is not; agents' clocks cannot order exits on two machines, but
        the victims' own words say who they were."""
        key, value = p.failure_key(self.prefix, number), json.dumps(failure).encode()
        if self._client.create_if_absent(key, value) or lost_a_peer(failure):
            return
        recorded = self._client.get(key)
        if recorded is not None and lost_a_peer(json.loads(recorded.value)):
            self._client.txn([mod_revision_is(key, recorded.mod_revision)], [Put(key, value)])

    def publish_event(self, record: dict) -> None:
        """A copy of an event for `status`, where it is this node's to copy (event_copy.py)."""
        self.event_copy.publish(record)

    def give_notice(self, round_number: int) -> None:
        """Announce that this node is about to be reclaimed (bound to our lease)."""
        record = json.dumps({"round": round_number}).encode()
        self._client.put(p.notice_key(self.prefix, self.node_id), record, lease=self.lease.id)

    def mark_in_place(self, round_number: int) -> None:
        """This node's workers re-form in place (they reported so in `round_number`).
        Written once per run: the script is the same on every node (the spec)."""
        if not self._marked_in_place:
            self._client.create_if_absent(p.inplace_key(self.prefix), json.dumps(
                {"round": round_number, "node": self.node_id}).encode())
            self._marked_in_place = True

    def etcd_answers_now(self) -> bool:
        """One status request, not retried (the agent's grace check: etcd_outage.py)."""
        try:
            self._client.server_version(retry_deadline_s=0.0)
        except EtcdUnavailable:
            return False
        except EtcdError:  # an answer, if not the one asked for: no outage
            pass
        return True

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
            self._cas_round(seen, p.RoundState(plan.round, p.FINISHED,
                                               p.Cause(p.CauseKind.FINISHED).text()))

    def change_reason(self, plan: p.Plan) -> p.Cause | None:
        """Why the workers of `plan` must stop, or None while the plan still holds.

        Asked every monitor tick; a non-deputy's answer depends only on its copy and
        its lease (whose loss wakes the copy), so while the copy's generation stands
        still the last "holds" stands too, at the cost of one read.
        """
        quiet = (plan.round, self.mirror.generation)
        if quiet == self._quiet_at:
            return None
        reason = self._change_reason(plan)
        if reason is None and not self.mirror.wide:
            self._quiet_at = quiet
        return reason

    def _change_reason(self, plan: p.Plan) -> p.Cause | None:
        seen = self.current_round()
        state = seen.state if seen else None
        change = d.plan_change(plan.round, state, self.lease.lost.is_set())
        if change is d.Watch.HOLDS:
            return None
        if isinstance(change, p.Cause) and d.newcomers_wait_after(plan.round, state):
            return self._members_gone_meanwhile(seen, plan) or change
        if change is not d.Watch.MEMBERS:
            return change
        if not self.deputies.ensure(self.lease.id):
            return None  # a deputy sees members go and opens the round: its key tells us
        return self._members_lost(seen, plan) or self._open_for_newcomers(seen, plan)

    def _members_lost(self, seen: RoundView, plan: p.Plan) -> p.Cause | None:
        """A deputy opens the next round once a member of `plan` lost the lease it
        joined with.

        Why its join, not its node key: both live under the lease the member joined
        `plan`'s round with, but an agent whose lease expired (a stall a little past
        --lease-ttl) registers again at once under a new one. Its node key is back
        within milliseconds, often before a deputy looks, while the member `plan`
        holds is gone: its agent has stopped its workers, and the others would wait
        for them (a round being formed, for its whole formation timeout). The join
        of `plan`'s round only comes back by joining that round again, which a
        closed round does not allow.
        """
        departures = self.mirror.census(p.nodes_prefix(self.prefix))[1]
        # Skipped while no node key was deleted since every member was seen live.
        if self._members_checked == (plan.round, departures):
            return None
        lost = d.lost_members(plan, self._joined_nodes(plan.round))
        if lost:
            lost = self._confirm_lost(seen, plan.round, lost)
        if lost:
            cause = p.Cause.member_lost(lost)
            self.open_next(seen, cause)
            return cause
        self._members_checked = (plan.round, departures)
        return None

    def _members_gone_meanwhile(self, seen: RoundView, plan: p.Plan) -> p.Cause | None:
        """A deputy marks the round open for newcomers after `plan` as one that lost
        a member, once a member of `plan` is gone or back under a new lease.

        Why: a newcomer round does not stop the plan's members (they form the
        plan's group, or train, and take the newcomer in afterwards), so a member
        lost meanwhile left the others waiting for its workers: a group being
        formed waited out the whole formation timeout (6 s in a chaos soak). No
        deputy looks at members once a later round opened, and the others see only
        the round key: its cause, now member-lost, tells them to stop. The round
        stays open with the joins it has.
        """
        if not self.deputies.ensure(self.lease.id):
            return None
        looked = ("newcomer round", seen.mod_revision,
                  self.mirror.census(p.nodes_prefix(self.prefix)))
        plan_kv = self.mirror.get(p.plan_key(self.prefix, plan.round))
        if plan_kv is None or self._members_checked == looked:
            return None
        created = {node: getattr(self.mirror.get(p.node_key(self.prefix, node)),
                                 "create_revision", 0) for node in plan.node_ids}
        gone = d.gone_since_plan(plan.node_ids, created, plan_kv.create_revision)
        if gone:
            gone = self._confirm_gone(seen, plan_kv.create_revision, gone)
        if not gone:
            self._members_checked = looked
            return None
        cause = p.Cause.member_lost(gone)
        if not self._cas_round(seen, p.RoundState(seen.state.number, p.OPEN, cause.text())):
            return None  # the round moved on: the next look reads why
        log.warning("round %d, open for newcomers, lost member(s) %s of round %d",
                    seen.state.number, ", ".join(gone), plan.round)
        return cause

    def _confirm_gone(self, seen: RoundView, plan_created: int,
                      gone: tuple[str, ...]) -> tuple[str, ...]:
        """`gone` as etcd has it (one read, rare), as _confirm_lost does for joins."""
        reads = self._read_while_round_is(seen, [Get(p.node_key(self.prefix, node))
                                                 for node in gone])
        if reads is None:
            return ()
        created = {node: read.kvs[0].create_revision
                   for node, read in zip(gone, reads) if read.kvs}
        confirmed = d.gone_since_plan(gone, created, plan_created)
        if confirmed != gone:
            self._reread_copy(f"{len(gone) - len(confirmed)} member(s)' node key")
        return confirmed

    def _read_while_round_is(self, seen: RoundView, reads: list[Get]) -> tuple | None:
        """`reads` answered by etcd while the round key is still `seen`, else None:
        once the next round opened, what was read for this one no longer decides.

        In transactions of at most MAX_TXN_OPS reads: etcd refuses a bigger one, and a
        mass loss (a zone's spot nodes reclaimed at once) asks about every member lost.
        A mod revision that held at each chunk held between them: it only grows."""
        answers: list = []
        for start in range(0, len(reads), MAX_TXN_OPS):
            result = self._client.txn([mod_revision_is(p.round_key(self.prefix),
                                                       seen.mod_revision)],
                                      reads[start:start + MAX_TXN_OPS])
            if not result.succeeded:
                return None
            answers.extend(result.reads)
        return tuple(answers)

    def _reread_copy(self, missed: str) -> None:
        """A member our copy took for gone that etcd still has: the copy is wrong."""
        log.warning("our copy of etcd missed %s; reading it again", missed)
        self.mirror.resync()
        self._last_look = None

    def _open_for_newcomers(self, seen: RoundView, plan: p.Plan) -> p.Cause | None:
        """The plan's first member opens the next round once a newcomer is due.

        It saw the newcomers register, so it tells a lone arrival (at once) from
        a burst (after the settle quiet) on its own clock; see newcomers.py.
        """
        wait = self.newcomers.members_wait(plan)
        cause = p.Cause.newcomer()  # a member opens it: no opener named
        if wait is None or wait > 0 or not self.open_next(seen, cause):
            return None
        return cause

    def _joined_nodes(self, number: int) -> set[str]:
        return {p.node_id_from_key(kv.key)
                for kv in self.mirror.children(p.join_prefix(self.prefix, number))}

    def _confirm_lost(self, seen: RoundView, number: int,
                      lost: tuple[str, ...]) -> tuple[str, ...]:
        """Members our copy misses that etcd still has mean the copy is wrong: re-read it.

        One read per suspected loss (rare): tearing down a running job because a
        watch dropped events would cost every node a restart. Read only while the
        round key is still `seen`: once the next round opened, each member's join of
        this one goes as it joins the next, which is no loss.
        """
        reads = self._read_while_round_is(seen, [Get(p.join_prefix(self.prefix, number),
                                                      prefix=True)])
        if reads is None:
            return ()  # the round moved on: the next look reads why
        joined = {p.node_id_from_key(kv.key) for kv in reads[0].kvs}
        if not joined & set(lost):
            return lost
        self._reread_copy(f"{len(joined & set(lost))} member(s)' join")
        return tuple(node for node in lost if node not in joined)

