"""Deputies against a real etcd: most agents copy only the round key (issue 17).

With `deputies=1` a handful of threads shows what a thousand nodes do: one agent
copies every key and decides; the others see O(1) events per round, however
many nodes join it, and take over when the deputy goes.
"""

from __future__ import annotations

import json

import pytest

from elastic_runner.errors import LeaseLost, LeaseNotFound
from elastic_runner.etcd.client import Put
from elastic_runner.rendezvous import protocol as p
from elastic_runner.worker.checkpoint.etcd_store import EtcdLatestStore
from tests.helpers.rdzv_nodes import wait_for, wait_for_agreement

# Per round, a non-deputy member sees the round key open and close (two events),
# whatever the number of nodes that join; one more leaves room for a finish.
FOLLOWER_EVENTS_PER_ROUND = 3


def split_roles(nodes):
    """(the deputy, the others) as etcd's slot keys say."""
    holders = nodes[0].rdzv.deputies.holders()
    assert len(holders) == 1, holders
    deputy = next(n for n in nodes if n.rdzv.node_id in holders)
    return deputy, [n for n in nodes if n is not deputy]


def events(nodes) -> list[int]:
    return [n.rdzv.mirror.events_delivered for n in nodes]


def test_a_member_that_is_no_deputy_sees_a_constant_number_of_events_per_round(node):
    everyone = [node("fan-out", f"a{i}", 16, deputies=1) for i in range(4)]
    start = wait_for_agreement(everyone, 4)
    deputy, followers = split_roles(everyone)
    assert deputy.rdzv.mirror.wide and not any(f.rdzv.mirror.wide for f in followers)
    for joining in (1, 5):  # one newcomer, then a burst: rounds of 5 and of 10 joins
        before, deputy_before = events(followers), deputy.rdzv.mirror.events_delivered
        everyone += [node("fan-out", f"n{len(everyone) + i}", 16, deputies=1)
                     for i in range(joining)]
        plan = wait_for_agreement(everyone, len(everyone))
        rounds = plan.round - start.round
        per_round = [(after - was) / rounds for was, after in zip(before, events(followers))]
        assert max(per_round) <= FOLLOWER_EVENTS_PER_ROUND, per_round
        # The deputy saw every registration and every join of those rounds.
        assert deputy.rdzv.mirror.events_delivered - deputy_before >= joining + len(everyone)
        start = plan


def test_a_deputy_that_leaves_is_replaced_and_the_next_round_closes(node):
    nodes = [node("leave", f"a{i}", 8, deputies=1) for i in range(3)]
    wait_for_agreement(nodes, 3)
    deputy, followers = split_roles(nodes)
    deputy.stop()  # revokes its lease: its node, join and slot keys go at once
    plan = wait_for_agreement(followers, 2)
    assert set(plan.node_ids) == {f.rdzv.node_id for f in followers}
    new_deputy, _ = split_roles(followers)
    assert new_deputy.rdzv.mirror.wide


def test_a_crashed_deputy_is_replaced_once_its_lease_expires(node):
    nodes = [node("crash", f"a{i}", 8, deputies=1, lease_ttl_s=2) for i in range(3)]
    wait_for_agreement(nodes, 3)
    deputy, followers = split_roles(nodes)
    crash(deputy)
    plan = wait_for_agreement(followers, 2)
    assert set(plan.node_ids) == {f.rdzv.node_id for f in followers}
    assert p.Cause.parse(plan.cause).kind is p.CauseKind.MEMBER_LOST
    assert split_roles(followers)[0] in followers


def crash(victim) -> None:
    """As SIGKILL would leave it: no more keep-alives, no revoke; its keys stay until
    the lease expires."""
    victim._stop.set()
    victim.rdzv.lease.stop()
    victim.rdzv.shutdown.set()
    victim.rdzv.mirror.stop()
    victim.rdzv.mirror.wake()


def test_a_join_refused_for_an_expired_lease_registers_again_and_joins(node):
    """What a CPU-starved agent meets: its keep-alive came too late, etcd dropped the
    lease, and the join write under it fails with "requested lease not found"."""
    first = node("starved", "a0", 8, deputies=1)
    wait_for_agreement([first], 1)
    late = node("starved", "a1", 8, deputies=1, begin=False)
    real_txn, refused = late.client.txn, []

    def txn(compares, success, failure=()):
        joins = [op for op in success if isinstance(op, Put) and "/join/" in op.key]
        if joins and not refused:
            late.client.revoke_lease(joins[0].lease)  # the TTL ran out while it slept
            try:
                return real_txn(compares, success, failure)
            except LeaseNotFound:
                refused.append(joins[0].lease)
                raise
        return real_txn(compares, success, failure)
    late.client.txn = txn
    late.start()
    plan = wait_for_agreement([first, late], 2)
    assert refused and late.rdzv.lease.id != refused[0]
    assert set(plan.node_ids) == {"a0", "a1"}


def test_a_deputy_slot_refused_for_an_expired_lease_registers_again(node):
    """A starved agent may find its lease gone when it tries a freed slot: the agent
    registers again instead of dying with "requested lease not found"."""
    first, late = (node("slot", f"a{i}", 8, deputies=1, begin=False) for i in range(2))
    first.rdzv.register()
    late.rdzv.register()
    assert first.rdzv.deputies.holds(first.rdzv.lease.id)
    stale = late.rdzv.lease.id
    late.rdzv.lease.stop()  # its keep-alive is starved: it has not heard yet
    late.client.revoke_lease(stale)
    first.rdzv.leave()  # frees the slot
    wait_for(lambda: not late.rdzv.deputies.holders(), "the slot to go", [late])
    assert late.rdzv.deputies.ensure(stale) is False
    assert late.rdzv.lease.lost.is_set()
    plan = late.rdzv.next_plan(None, p.Cause(p.CauseKind.START))
    assert plan.node_ids == ("a1",) and late.rdzv.lease.id != stale
    assert late.rdzv.deputies.holds(late.rdzv.lease.id)


def test_a_lease_found_gone_is_reported_to_a_caller_that_must_not_register_yet(node):
    """An agent whose workers still sit in their round asks with rejoin=False: the
    lease found gone raises LeaseLost and nothing is written; asked again (its
    workers out), it registers under a new lease and joins the others' round."""
    # settle_max_s: whether a1 holds the deputy slot is a race. Without it, a1's copy
    # is narrow and, its registration gone with the lease, nobody opens a round for
    # it: it opens one itself (and hits the refusal) only after settle_max_s (30 s by
    # default). A live agent's keep-alive finds the lease gone sooner; here it is off.
    stays, thawed = node("thawed", "a0", 8, deputies=1), node("thawed", "a1", 8,
                                                               deputies=1, begin=False,
                                                               settle_max_s=3.0)
    thawed.rdzv.register()
    plan = thawed.rdzv.next_plan(None, p.Cause(p.CauseKind.START))
    wait_for_agreement([stays], 2)
    stale = thawed.rdzv.lease.id
    thawed.rdzv.lease.stop()  # frozen: no keep-alive, and etcd drops the lease
    thawed.client.revoke_lease(stale)
    wait_for(lambda: stays.plans[-1].node_ids == ("a0",), "a0 to re-form alone", [stays])
    with pytest.raises(LeaseLost):
        thawed.rdzv.next_plan(plan, p.Cause(p.CauseKind.NEWCOMER), rejoin=False)
    assert thawed.rdzv.lease.id == stale
    assert thawed.client.get(p.node_key(thawed.rdzv.prefix, "a1")) is None
    again = thawed.rdzv.next_plan(plan, p.Cause(p.CauseKind.LEASE_EXPIRED))
    assert set(again.node_ids) == {"a0", "a1"} and thawed.rdzv.lease.id != stale
    assert wait_for_agreement([stays], 2).round == again.round


class PlanReads:
    """The client of one agent, counting its reads of whole plans."""

    def __init__(self, client):
        self._client, self.plan_reads = client, 0

    def __getattr__(self, name):
        return getattr(self._client, name)

    def get(self, key, *args, **kwargs):
        self.plan_reads += key.endswith("/plan")
        return self._client.get(key, *args, **kwargs)


def test_members_rebuild_each_plan_from_the_round_key_edit_and_a_newcomer_reads_it(node):
    """The round key carries a leave or a join as an edit of the previous plan
    (carried_plan.py), so its size follows the change, not N; every member rebuilds
    the very plan the deputy wrote, without reading it."""
    nodes = [node("edit", f"a{i:02d}", 16, deputies=1) for i in range(12)]
    wait_for_agreement(nodes, 12)
    for n in nodes:
        n.rdzv._client = PlanReads(n.rdzv._client)
    leaver = nodes.pop(5)
    leaver.stop()
    plan = wait_for_agreement(nodes, 11)
    newcomer = node("edit", "late", 16, begin=False, deputies=1)
    newcomer.rdzv._client = PlanReads(newcomer.rdzv._client)
    newcomer.start()
    joined = wait_for_agreement(nodes + [newcomer], 12)
    stored = nodes[0].client.get(p.plan_key(nodes[0].rdzv.prefix, joined.round))
    assert p.Plan.from_json(stored.value) == joined and joined.round > plan.round
    assert "a05" not in plan.node_ids and joined.node_ids[-1] == "late"
    round_value = nodes[0].client.get(p.round_key(nodes[0].rdzv.prefix)).value
    runs = json.loads(round_value)["plan_delta"]["runs"]
    assert runs[0] == [0, 11] and runs[1]["id"] == "late" and len(runs) == 2
    assert [n.rdzv._client.plan_reads for n in nodes] == [0] * len(nodes)
    assert newcomer.rdzv._client.plan_reads >= 1  # it held no earlier plan to edit


class Sent:
    """One agent's requests to etcd, in order: ("txn", the key its compare guards) or
    (a read's name, its key)."""

    def __init__(self, client):
        self.requests: list[tuple[str, str]] = []
        for name in ("txn", "get", "get_range", "get_prefix", "count_prefix"):
            setattr(client, name, self._counted(name, getattr(client, name)))

    def _counted(self, name, real):
        def call(*args, **kwargs):
            key = args[0][0].key if name == "txn" and args[0] else str(args[0] if args else "")
            self.requests.append((name, key))
            return real(*args, **kwargs)
        return call


def test_at_a_start_an_agent_sends_one_transaction_only(node, etcd):
    """Registration's one transaction checks the job spec, opens round 0 where there is
    none, takes the first free deputy slot, joins round 0 and reads the range the copy
    starts from. Before that, each of a thousand agents starting at once read the range
    itself, and most then raced to create round 0 and a slot that an earlier agent had
    created. (The first agent, which writes the spec, takes the steps one by one.)"""
    nodes = [node("start", f"a{i}", 8, begin=False, min_nodes=8) for i in range(8)]
    sent = [Sent(each.client) for each in nodes]
    nodes[0].start()  # writes the spec; the others start together once it is there
    wait_for(lambda: nodes[0].rdzv.lease is not None, "a0 to register", nodes)
    for each in nodes[1:]:
        each.start()
    plan = wait_for_agreement(nodes, 8)
    assert plan.round == 0 and len(plan.node_ids) == 8
    prefix = nodes[0].rdzv.prefix
    deputies = {i for i, each in enumerate(nodes) if each.rdzv.mirror.wide}
    assert len(deputies) == 3 and len(nodes[0].rdzv.deputies.holders()) == 3
    assert ("txn", p.spec_key(prefix)) in sent[0].requests  # a0: step by step
    for i, each in enumerate(nodes):
        if i in deputies or i == 0:
            continue
        assert sent[i].requests == [("txn", p.node_key(prefix, f"a{i}"))]  # the registration
    client = nodes[0].client
    for slot in range(3):  # each slot written once, by the registration that took it
        assert client.get(f"{p.deputy_prefix(prefix)}{slot}").version == 1
    guarded = [(i, key) for i in range(8) for name, key in sent[i].requests if name == "txn"]
    assert not [key for _, key in guarded if key.startswith(p.deputy_prefix(prefix))]
    assert {i for i, key in guarded if key == p.round_key(prefix)} <= deputies  # the close
    assert client.get(p.round_key(prefix)).version == 2  # opened once, closed once


def test_a_node_keeps_one_join_key_however_many_rounds_it_joined(node):
    """Each join deletes the node's join of its earlier round in the same write: join keys
    live under the node's lease, and before, etcd and every deputy's copy kept N keys
    per round for as long as the nodes lived."""
    first = [node("rounds", f"a{i}", 8) for i in range(2)]
    wait_for_agreement(first, 2)
    late = node("rounds", "a2", 8)
    wait_for_agreement(first + [late], 3)
    late.stop()
    plan = wait_for_agreement(first, 2)
    assert plan.round >= 2
    prefix = first[0].rdzv.prefix
    kvs, _ = first[0].client.get_prefix(f"{prefix}rounds/")
    joins = sorted(kv.key for kv in kvs if "/join/" in kv.key)
    assert joins == [p.join_key(prefix, plan.round, f"a{i}") for i in range(2)]
    wide = [each for each in first if each.rdzv.mirror.wide]
    assert wide and all(  # a deputy's copy holds the same, not the joins of every round
        sorted(kv.key for n in range(plan.round + 1)
               for kv in each.rdzv.mirror.children(p.join_prefix(prefix, n))) == joins
        for each in wide)


def test_closing_a_round_empties_the_plan_two_rounds_back_and_the_fence_still_holds(node, etcd):
    """Plans stayed in etcd and in every deputy's copy for the run (8-21 KB each at
    1,024 members, a round every few minutes on a spot fleet). The key of an old plan
    must stay: a checkpoint writer of the round before it is fenced by its existence."""
    first = [node("pruned", f"a{i}", 8) for i in range(2)]
    start = wait_for_agreement(first, 2)
    prefix, client = first[0].rdzv.prefix, first[0].client
    client.put(p.store_prefix(prefix, start.round) + "torch-key", b"1")  # the plug-in's store
    late = node("pruned", "a2", 8)
    wait_for_agreement(first + [late], 3)
    late.stop()
    wait_for_agreement(first, 2)
    later = node("pruned", "a3", 8)
    plan = wait_for_agreement(first + [later], 3)
    assert plan.round >= start.round + 3
    plans = {n: client.get(p.plan_key(prefix, n)) for n in range(plan.round + 1)}
    assert all(plans[n] is not None for n in plans)  # every key stays
    assert [n for n in plans if plans[n].value == p.SUPERSEDED_PLAN] == \
        list(range(plan.round - 1))
    assert p.plan_from(plans[plan.round].value) == plan
    assert p.plan_from(plans[plan.round - 1].value).round == plan.round - 1
    assert client.get_prefix(p.store_prefix(prefix, start.round))[0] == []
    for deputy in (n for n in first + [later] if n.rdzv.mirror.wide):
        held = [kv for n in plans if (kv := deputy.rdzv.mirror.get(p.plan_key(prefix, n)))]
        assert sum(len(kv.value) for kv in held) == \
            len(plans[plan.round].value) + len(plans[plan.round - 1].value)
    record = {"url": "file:///c/step-9", "step": 9, "sha256": "ab" * 32, "world_size": 2}
    stale, current = (EtcdLatestStore((etcd.endpoint,), prefix, number)
                      for number in (start.round, plan.round))
    assert not stale.publish(record)       # fenced by round start+1's emptied plan key
    assert current.publish(record)
    stale.close()
    current.close()
