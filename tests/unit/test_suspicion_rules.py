"""Suspicion (issue 15) in decisions.py: how a round opened on a survivor's failed
collective waits for the previous plan's members, and how the nodes it left out are
treated later. Split from test_protocol_decisions.py for size; its helpers are shared."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic_runner.rendezvous import decisions as d
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.ranks import build_plan, rank_order
from tests.unit.test_protocol_decisions import PROPS, look, plan


# ---- suspicion: a survivor's failed collective, before any lease expired (issue 15) ---
SUSPECT = d.RoundRules(min_nodes=2, max_nodes=4, settle_s=2.0, settle_max_s=30.0,
                       drain_timeout_s=30.0, suspect_grace_s=1.0)
ABC = {"a": 0.0, "b": 0.0, "c": 0.0}  # c was SIGKILLed: its key lives until its lease expires


def test_member_suspected_says_who_saw_what():
    cause = p.Cause.member_suspected("a rank 1", "allreduce timed out")
    assert cause.text() == "member-suspected: a rank 1: allreduce timed out"
    assert p.Cause.parse(cause.text()) == cause


@pytest.mark.parametrize("state, opens", [
    (p.RoundState(3, p.CLOSED), True),
    (p.RoundState(4, p.OPEN), False),     # another survivor (or a loss) opened it already
    (p.RoundState(4, p.CLOSED), False),   # ... and it even closed
    (p.RoundState(3, p.FINISHED), False),
    (p.RoundState(3, p.FAILED), False),
    (None, False),
])
def test_suspicion_opens_only_the_round_after_the_current_plan(state, opens):
    assert d.suspicion_opens(state, 3) is opens


def test_a_suspected_round_waits_for_a_silent_member_only_for_the_grace():
    view = look({"a", "b"}, ABC, previous=("a", "b", "c"), min_met_at=0.1, opened_at=0.0)
    suspected = dataclasses.replace(view, suspected=True)
    inputs, timers = d.close_inputs(suspected, 0.9, SUSPECT)
    assert inputs.members_draining and not p.may_close(inputs)
    assert pytest.approx(0.1) in timers  # it looks again when the grace ends
    assert d.suspect_left_out(suspected, 0.9, SUSPECT) == frozenset()
    inputs, _ = d.close_inputs(suspected, 1.0, SUSPECT)
    assert inputs.all_live_joined and not inputs.members_draining and p.may_close(inputs)
    assert d.suspect_left_out(suspected, 1.0, SUSPECT) == {"c"}
    # The same round opened for any other reason still waits for c's lease (or the drain).
    inputs, _ = d.close_inputs(view, 1.0, SUSPECT)
    assert not p.may_close(inputs)


def test_a_suspected_round_never_closes_below_the_minimum():
    view = d.RoundLook(frozenset({"a"}), 1, ABC, ("a", "b", "c"), None, 0.0, 100.0, True)
    inputs, _ = d.close_inputs(view, 50.0, SUSPECT)
    assert not p.may_close(inputs)


def test_a_suspected_round_still_settles_for_a_newcomer_arriving_meanwhile():
    """Only previous members are left out: a live newcomer that has not joined holds
    the round by the usual rule."""
    view = d.RoundLook(frozenset({"a", "b"}), 2, {**ABC, "n": 0.5}, ("a", "b", "c"), 0.1,
                       0.0, 100.0, True)
    inputs, _ = d.close_inputs(view, 2.0, SUSPECT)
    assert not inputs.all_live_joined and not p.may_close(inputs)


def test_a_member_left_out_does_not_spend_a_restart():
    before = plan([("a", 1), ("b", 1), ("c", 1)], restarts=2)
    assert d.restart_verdict(before, True, ("a", "b"), 2) == d.RestartVerdict(2, False)


def test_the_first_member_does_not_open_a_round_for_a_member_left_out():
    before = plan([("a", 1), ("b", 1), ("c", 1)])
    after = p.Plan(4, before.members[:2], "10.0.0.1", 29500,
                   cause=p.Cause.member_suspected("a", "allreduce failed").text())
    assert d.left_out_on_suspicion(after, before) == {"c"}
    assert d.left_out_on_suspicion(after, None) == frozenset()
    lost = p.Plan(4, before.members[:2], "10.0.0.1", 29500, cause="member-lost: c")
    assert d.left_out_on_suspicion(lost, before) == frozenset()  # c's key is gone anyway


GRACE_RULES = st.builds(
    lambda lo, extra, grace, settle, workers: d.RoundRules(
        min_nodes=lo, max_nodes=lo + extra, settle_s=settle, settle_max_s=settle + 30.0,
        drain_timeout_s=grace + 30.0, suspect_grace_s=grace, max_workers=workers),
    st.integers(1, 4), st.integers(0, 4), st.floats(0.0, 5.0), st.floats(0.0, 3.0),
    st.sampled_from([0, 3, 6]))


@st.composite
def suspected_rounds(draw):
    """A round opened for a suspicion: previous members (some dead with live keys),
    maybe newcomers, some of each joined; times on the deciding agent's clock."""
    previous = [f"m{i}" for i in range(draw(st.integers(1, 6)))]
    newcomers = [f"n{i}" for i in range(draw(st.integers(0, 3)))]
    gone = set(draw(st.lists(st.sampled_from(previous), unique=True)))  # keys expired
    live = [node for node in previous + newcomers if node not in gone]
    joined = frozenset(draw(st.lists(st.sampled_from(live), unique=True))) if live else \
        frozenset()
    opened_at = draw(st.floats(-1e3, 1e3))
    registered = {node: opened_at - draw(st.floats(0.0, 100.0)) for node in live}
    min_met_at = draw(st.none() | st.floats(0.0, 10.0).map(lambda x: opened_at + x))
    return d.RoundLook(joined, len(joined), registered, tuple(previous), min_met_at,
                       opened_at, opened_at + 1e5, suspected=True)


@PROPS
@given(suspected_rounds(), GRACE_RULES, st.floats(0.0, 60.0))
def test_a_suspected_round_obeys_its_grace(view, rules, elapsed):
    now = view.opened_at + elapsed
    if view.min_met_at is not None and view.min_met_at > now:
        view = dataclasses.replace(view, min_met_at=None)
    inputs, timers = d.close_inputs(view, now, rules)
    closable = p.may_close(inputs)
    silent = (set(view.previous) & set(view.registered)) - view.joined
    # Never below the minimum, whatever the grace.
    if closable:
        assert len(view.joined) >= rules.min_nodes
    full = len(view.joined) >= rules.max_nodes or (
        rules.max_workers and view.workers >= rules.max_workers)
    if now < view.opened_at + rules.suspect_grace_s:
        # Before the grace a live member that has not joined is waited for (only a
        # full round closes without it), and the agent looks again when it ends.
        if silent and not full:
            assert not closable
            assert any(t == pytest.approx(view.opened_at + rules.suspect_grace_s - now)
                       for t in timers)
    else:
        # After it, previous members that did not join are neither waited for ...
        assert d.suspect_left_out(view, now, rules) == set(view.previous) - view.joined
        assert not inputs.members_draining
        # ... nor, once every other live node joined and the minimum is met, a reason
        # to keep the round open; and the plan, built from joiners, leaves them out.
        others_joined = set(view.registered) - silent <= view.joined
        if others_joined and d.minimum_met(len(view.joined), view.workers, rules):
            assert closable
        if closable:
            joiners = [p.Joiner(n, "10.0.0.1", 1, 1, i) for i, n in enumerate(sorted(view.joined))]
            members = build_plan(5, rank_order(view.previous, joiners), rules.max_nodes, 0,
                                 "member-suspected").node_ids
            assert not silent & set(members)
            survivors = [n for n in view.previous if n in members]
            assert list(members[:len(survivors)]) == survivors  # stable order kept


def test_a_later_round_does_not_wait_for_a_node_left_out_on_suspicion():
    """c was left out on suspicion earlier and its key still lives (its lease): a
    round opened for a newcomer, or a notice, must not wait for it until it expires.
    Alive, c would have come back through a round of its own."""
    registered = {"a": 0.0, "b": 0.0, "c": 0.0, "n": 0.5}
    view = d.RoundLook(frozenset({"a", "b", "n"}), 3, registered, ("a", "b"), 0.6, 0.0,
                       100.0, suspected=False, suspects=frozenset({"c"}))
    inputs, _ = d.close_inputs(view, 0.1, SUSPECT)
    assert inputs.all_live_joined and p.may_close(inputs)  # c no longer counts as live
    assert d.suspect_left_out(view, 0.1, SUSPECT) == {"c"}
    # A suspect that did come back and joined is simply a member of the round.
    back = dataclasses.replace(view, joined=frozenset({"a", "b", "c", "n"}), workers=4)
    assert d.suspect_left_out(back, 5.0, SUSPECT) == frozenset()
    # Without the memory, the same round waits for c (settle, up to --settle-max).
    inputs, _ = d.close_inputs(dataclasses.replace(view, suspects=frozenset()), 5.0, SUSPECT)
    assert not inputs.all_live_joined and not p.may_close(inputs)


def test_the_round_a_suspect_opens_itself_waits_for_it():
    """c, left out on suspicion and alive, opened round 2 itself; the members joined
    it before c did (two writes apart). Counting c as a suspect there closed the
    round with the same two members and made c open a third."""
    assert d.round_opener(p.Cause.newcomer("c")) == {"c"}
    assert d.round_opener(p.Cause.newcomer()) == frozenset()  # a member opened it
    assert d.round_opener(p.Cause.member_suspected("c", "x")) == frozenset()
    assert d.round_opener(p.Cause.parse(p.Cause.newcomer("c").text())) == {"c"}  # as etcd holds it
    registered = {"a": 0.0, "b": 0.0, "c": 0.0}
    opened = p.Cause.parse(d.outsider_action(True, 0.0, "c").cause.text())
    view = d.RoundLook(frozenset({"a", "b"}), 2, registered, ("a", "b"), 0.1, 0.0, 100.0,
                       suspects=frozenset({"c"}) - d.round_opener(opened))
    inputs, _ = d.close_inputs(view, 0.2, SUSPECT)
    assert not inputs.all_live_joined and not p.may_close(inputs)  # waits for c
    joined = dataclasses.replace(view, joined=frozenset(registered), workers=3)
    assert p.may_close(d.close_inputs(joined, 0.2, SUSPECT)[0])
