"""EtcdRendezvous driven by threads against a real etcd: how arrivals become rounds.

No sleep stands in for synchronisation: a test that needs an arrival to have
happened waits until etcd (as the first node's copy shows it) holds it, with a
generous deadline, so a slow machine makes a test slower, not wrong.
"""

from __future__ import annotations

import time

from elastic_runner.rendezvous import protocol as p
from tests.helpers.rdzv_nodes import arrive, wait_for_agreement


def test_a_burst_of_newcomers_costs_two_reformations_not_one_each(node):
    first = [node("burst", f"a{i}", 16) for i in range(4)]
    start = wait_for_agreement(first, 4)
    # 8 arrivals one after another (connected beforehand, so each takes a few
    # requests): all well inside one settle period, yet each a distinct arrival.
    newcomers = [node("burst", f"b{i}", 16, begin=False) for i in range(8)]
    for newcomer in newcomers:
        arrive(newcomer, first, p.node_key)
    plan = wait_for_agreement(first + newcomers, 12)
    # The first newcomer sees no recent arrival and opens a round at once; the
    # rest see it and wait for a quiet --settle, then share one more round.
    assert plan.round - start.round in (1, 2)
    assert [m.node_id for m in plan.members[:4]] == [m.node_id for m in start.members]
    assert sorted(m.first_rank for m in plan.members) == list(range(12))


def test_a_single_newcomer_and_a_leave_each_cost_one_round(node):
    nodes = [node("single", f"n{i}", 8) for i in range(3)]
    start = wait_for_agreement(nodes, 3)
    nodes.append(node("single", "late", 8))
    grown = wait_for_agreement(nodes, 4)
    assert grown.round == start.round + 1
    assert grown.members[-1].node_id == "late"
    leaver = nodes.pop(1)
    leaver.stop()
    shrunk = wait_for_agreement(nodes, 3)
    assert shrunk.round == grown.round + 1
    assert leaver.rdzv.node_id not in shrunk.node_ids


def test_a_slow_start_closes_once_when_arrivals_stop(node):
    """Nodes of one job booting one after another end up in the first round together:
    each boots once the one before it has joined round 0."""
    nodes = [node("staggered", f"s{i}", 16, begin=False) for i in range(6)]
    for booting in nodes:
        arrive(booting, nodes, lambda prefix, node_id: p.join_key(prefix, 0, node_id))
    plan = wait_for_agreement(nodes, 6)
    assert plan.round == 0


def test_a_copy_that_missed_a_node_is_read_again_not_taken_for_a_loss(node):
    """A watch that dropped events must not tear down a running job."""
    nodes = [node("resync", f"r{i}", 4) for i in range(2)]
    plan = wait_for_agreement(nodes, 2)
    observer = nodes[0].rdzv
    other_keys = (p.node_key(observer.prefix, "r1"), p.join_key(observer.prefix, plan.round, "r1"))
    with observer.mirror._changed:  # as if the watch never delivered r1's writes
        for key in other_keys:
            observer.mirror._drop(key)
    assert observer.mirror.get(other_keys[1]) is None
    assert observer.change_reason(plan) is None
    assert all(observer.mirror.get(key) is not None for key in other_keys)
    assert observer.current_round().state.number == plan.round  # no round was opened
    assert all(n.plans[-1].round == plan.round for n in nodes)


def test_the_first_member_opens_at_once_for_a_lone_newcomer(node):
    """A newcomer cannot tell how old the node keys it found are, so its own rule
    waits --settle; the plan's first member saw every arrival and opens at once."""
    members = [node("lone", f"m{i}", 4, settle_s=0.5) for i in range(2)]
    before = wait_for_agreement(members, 2)
    arrived = time.monotonic()
    newcomer = node("lone", "new", 4, settle_s=30.0, settle_max_s=60.0)
    plan = wait_for_agreement(members + [newcomer], 3)
    assert plan.round == before.round + 1 and plan.cause == "newcomer"
    assert newcomer.admitted_at[0] - arrived < 30.0  # not the newcomer's own 30 s wait


def test_a_newcomer_opens_the_round_itself_when_the_first_member_does_not(node):
    members = [node("backup", f"m{i}", 4, settle_s=0.5) for i in range(2)]
    before = wait_for_agreement(members, 2)
    first = next(n for n in members if n.rdzv.node_id == before.members[0].node_id)
    first.rdzv.newcomers.members_wait = lambda plan: None  # as if it were hung
    newcomer = node("backup", "new", 4, settle_s=0.5)
    plan = wait_for_agreement(members + [newcomer], 3)
    assert plan.round == before.round + 1
    assert p.Cause.parse(plan.cause) == p.Cause.newcomer("new")  # it opened the round itself
