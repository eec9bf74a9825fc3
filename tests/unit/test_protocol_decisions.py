"""Unit and property tests of the engine's decisions (rendezvous/decisions.py) and of
round causes (protocol.Cause): pure functions, no etcd."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_runner.rendezvous import decisions as d
from elastic_runner import ids
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.ranks import build_plan, rank_order

PROPS = settings(max_examples=200, deadline=None)
NODE_IDS = st.from_regex(ids.ID_GRAMMAR, fullmatch=True).filter(lambda i: ids.id_problem(i) is None)
TIMES = st.floats(-1e6, 1e6, allow_nan=False)
K = p.CauseKind


def plan(members: list[tuple[str, int]], restarts: int = 0) -> p.Plan:
    joiners = [p.Joiner(node, f"10.0.0.{i + 1}", 29500, nproc, i)
               for i, (node, nproc) in enumerate(members)]
    return build_plan(3, joiners, max(len(joiners), 1), restarts, "start")


# ---- Cause: one text for etcd and logs, read back by kind ----------------------------
@pytest.mark.parametrize("cause, text", [
    (p.Cause(K.START), "start"),
    (p.Cause.member_lost(["b", "c"]), "member-lost: b,c"),
    (p.Cause(K.MEMBER_SUSPECTED, "a rank 1: allreduce timed out"),
     "member-suspected: a rank 1: allreduce timed out"),
    (p.Cause(K.MEMBER_SUSPECTED), "member-suspected"),
    (p.Cause(K.NEWCOMER), "newcomer"),
    (p.Cause(K.WORKER_FAILURE, "rank 0 on a"), "worker-failure: rank 0 on a"),
    (p.Cause(K.WORKER_FAILURE), "worker-failure"),
    (p.Cause(K.NOTICE), "workers checkpointed and stopped for a spot notice"),
    (p.Cause(K.ETCD_OUTAGE), "etcd outage"),
    (p.Cause(K.LEASE_EXPIRED), "this node's lease expired"),
    (p.Cause(K.FINISHED), "workers succeeded"),
    (p.Cause(K.OTHER, "torchrun restarted the workers"), "torchrun restarted the workers"),
])
def test_each_cause_has_the_text_agents_have_always_written(cause, text):
    assert cause.text() == str(cause) == text
    assert p.Cause.parse(text) == cause


@pytest.mark.parametrize("older, cause", [
    ("member(s) lost: a, b", p.Cause.member_lost(["a", "b"])),
    ("round 4 opened (newcomer)", p.Cause(K.NEWCOMER)),
    ("round 4 opened (member-lost: a)", p.Cause.member_lost(["a"])),
    ("round ? opened (round key deleted)", p.Cause(K.OTHER, "round key deleted")),
    ("scale-up", p.Cause(K.OTHER, "scale-up")),
    ("", p.Cause(K.OTHER, "")),
])
def test_texts_an_older_agent_wrote_parse_to_a_kind_or_to_other(older, cause):
    assert p.Cause.parse(older) == cause


def test_a_node_id_in_the_detail_never_changes_the_kind():
    assert p.Cause.parse("member-lost: newcomer-3").kind is K.MEMBER_LOST
    assert p.Cause.parse("member-suspected: member-lost: b").kind is K.MEMBER_SUSPECTED
    assert p.Cause.parse("worker-failure: rank 0 on member-2").kind is K.WORKER_FAILURE


@PROPS
@given(st.sampled_from([k for k in K if k is not K.OTHER]), st.text(max_size=30))
def test_every_cause_reads_back_as_itself(kind, detail):
    cause = p.Cause(kind, detail)
    assert p.Cause.parse(cause.text()) == cause


@PROPS
@given(st.text(max_size=40))
def test_parsing_any_text_never_fails_and_is_stable(text):
    cause = p.Cause.parse(text)
    assert p.Cause.parse(cause.text()) == cause


# ---- round_action: the round key decides --------------------------------------------
START = p.Cause(K.START)


@pytest.mark.parametrize("state, previous, act", [
    (None, None, d.Act.CREATE_FIRST),
    (None, 4, d.Act.CREATE_FIRST),
    (p.RoundState(2, p.FINISHED), None, d.Act.RUN_FINISHED),
    (p.RoundState(2, p.FAILED), 2, d.Act.RUN_FAILED),
    (p.RoundState(2, p.CLOSED), 2, d.Act.OPEN_NEXT),
    (p.RoundState(2, p.OPEN), 3, d.Act.OPEN_NEXT),
    (p.RoundState(3, p.OPEN), 2, d.Act.IN_OPEN_ROUND),
    (p.RoundState(0, p.OPEN), None, d.Act.IN_OPEN_ROUND),
    (p.RoundState(3, p.CLOSED), 2, d.Act.IN_CLOSED_ROUND),
])
def test_round_action_table(state, previous, act):
    assert d.round_action(state, previous, START).act is act


def test_a_round_opened_for_a_change_records_its_cause():
    lost = p.Cause.member_lost(["b"])
    assert d.round_action(p.RoundState(2, p.CLOSED), 2, lost) == d.Action(d.Act.OPEN_NEXT, lost)
    assert d.round_action(None, None, lost).cause == START  # round 0 always starts


# ---- room for newcomers --------------------------------------------------------------
@pytest.mark.parametrize("nproc, max_nodes, max_workers, room", [
    (1, 3, 0, True),
    (1, 2, 0, False),        # --max-nodes reached
    (2, 3, 5, True),         # 3 + 2 workers fit under 5
    (3, 3, 5, False),        # 3 + 3 would not
    (1, 3, 3, False),
])
def test_has_room_table(nproc, max_nodes, max_workers, room):
    current = plan([("a", 1), ("b", 2)])
    assert d.has_room(current, nproc, max_nodes, max_workers) is room


@PROPS
@given(st.lists(st.integers(1, 8), min_size=1, max_size=10),
       st.lists(st.integers(1, 8), max_size=10), st.integers(1, 12), st.integers(0, 40))
def test_admitting_while_there_is_room_never_exceeds_the_limits(members, arrivals, max_nodes,
                                                               max_workers):
    """Members start within the limits; newcomers are admitted one by one while has_room."""
    current = plan([(f"m{i}", n) for i, n in enumerate(members)])
    if len(current.members) > max_nodes or (max_workers and current.world_size > max_workers):
        return
    for i, nproc in enumerate(arrivals):
        if d.has_room(current, nproc, max_nodes, max_workers):
            current = plan([(m.node_id, m.nproc) for m in current.members] + [(f"n{i}", nproc)])
        assert len(current.members) <= max_nodes
        assert not max_workers or current.world_size <= max_workers


@PROPS
@given(st.lists(st.integers(1, 8), min_size=1, max_size=8), st.integers(1, 8),
       st.integers(1, 10), st.integers(0, 40))
def test_a_node_with_room_is_taken_by_the_next_plan(members, nproc, max_nodes, max_workers):
    """has_room agrees with build_plan: survivors first, so the newcomer fits after them."""
    current = plan([(f"m{i}", n) for i, n in enumerate(members)])
    if len(current.members) > max_nodes or (max_workers and current.world_size > max_workers):
        return
    if not d.has_room(current, nproc, max_nodes, max_workers):
        return
    joiners = [p.Joiner(m.node_id, m.addr, 1, m.nproc, i) for i, m in enumerate(current.members)]
    joiners.append(p.Joiner("new", "10.9.9.9", 1, nproc, 99))
    order = rank_order(current.node_ids, joiners)
    assert "new" in build_plan(4, order, max_nodes, 0, "newcomer", max_workers).node_ids


def test_outsider_action():
    assert d.outsider_action(False, 0.0, "n") == d.Action(d.Act.WAIT, wait_s=d.STANDBY_WAIT_S)
    assert d.outsider_action(True, 1.5, "n") == d.Action(d.Act.WAIT, wait_s=1.5)
    assert d.outsider_action(True, 0.0, "n") == d.Action(d.Act.OPEN_NEXT,
                                                          p.Cause(K.NEWCOMER, "n"))


# ---- the closer: one is elected, the others are backups --------------------------------
JOINS = st.lists(st.tuples(NODE_IDS, st.integers(1, 10**9)), min_size=1, max_size=12,
                 unique_by=(lambda j: j[0], lambda j: j[1]))


@PROPS
@given(JOINS, st.randoms(use_true_random=False), TIMES, st.floats(0, 1e3),
       st.floats(0.01, 100))
def test_exactly_one_closer_is_elected_for_any_joiners_and_any_clock(joins, rnd, since,
                                                                     elapsed, settle):
    shuffled = list(joins)
    rnd.shuffle(shuffled)
    closer = d.elect_closer(joins)
    assert d.elect_closer(shuffled) == closer  # every agent's copy lists them its own way
    assert closer == min(joins, key=lambda j: j[1])[0]  # the first to join
    now = since + min(elapsed, settle * 0.999)  # before the backups' turn
    may = [node for node, _ in joins if d.closer_wait(node, closer, since, now, settle) <= 0]
    assert may == [closer]


@PROPS
@given(JOINS, TIMES, st.floats(0.01, 100), st.floats(0, 1e3))
def test_backups_step_in_after_settle(joins, since, settle, extra):
    closer = d.elect_closer(joins)
    now = since + settle + extra
    assert all(d.closer_wait(node, closer, since, now, settle) <= 1e-6 for node, _ in joins)


@pytest.mark.parametrize("backup_wait, joined, step", [
    (0.5, 4, d.CloseStep.WAIT),
    (0.5, 8, d.CloseStep.WAIT),
    (0.0, 4, d.CloseStep.VERIFY_COPY),
    (-1.0, 7, d.CloseStep.VERIFY_COPY),
    (0.0, 8, d.CloseStep.CLOSE),  # at --max-nodes no joiner can be missing
])
def test_close_step_table(backup_wait, joined, step):
    assert d.close_step(backup_wait, joined, max_nodes=8) is step


# ---- close inputs from one look at an open round ---------------------------------------
RULES = d.RoundRules(min_nodes=2, max_nodes=4, settle_s=2.0, settle_max_s=30.0,
                     drain_timeout_s=10.0)


def look(joined, registered, previous=None, min_met_at=None, opened_at=0.0, deadline=100.0):
    return d.RoundLook(frozenset(joined), len(joined), registered, previous, min_met_at,
                       opened_at, deadline)


def test_close_inputs_first_round_settles_after_the_minimum():
    view = look({"a", "b"}, {"a": 0.0, "b": 1.0}, min_met_at=1.0)
    inputs, timers = d.close_inputs(view, 2.0, RULES)
    assert inputs.first_round and inputs.all_live_joined and not inputs.settle_elapsed
    assert not p.may_close(inputs)
    assert min(t for t in timers if t > 0) == pytest.approx(1.0)  # settle from 1.0
    inputs, _ = d.close_inputs(view, 3.5, RULES)
    assert p.may_close(inputs)


def test_close_inputs_wait_for_draining_members_until_the_drain_timeout():
    view = look({"a", "c"}, {"a": 0.0, "b": 0.0, "c": 0.0}, previous=("a", "b"),
                min_met_at=0.0, opened_at=0.0)
    inputs, timers = d.close_inputs(view, 5.0, RULES)
    assert inputs.members_draining and not inputs.all_live_joined
    assert 5.0 in [pytest.approx(t) for t in timers]  # the drain timeout is a timer
    inputs, _ = d.close_inputs(view, 11.0, RULES)
    assert not inputs.members_draining


def test_close_inputs_without_the_minimum_have_no_settle_timer():
    inputs, timers = d.close_inputs(look({"a"}, {"a": 0.0}), 5.0, RULES)
    assert not inputs.settle_elapsed and not p.may_close(inputs)
    assert sorted(timers) == [pytest.approx(5.0), pytest.approx(95.0)]


def test_minimum_met_counts_nodes_and_workers():
    rules = d.RoundRules(min_nodes=2, max_nodes=4, min_workers=4)
    assert d.minimum_met(2, 4, rules) and not d.minimum_met(2, 3, rules)
    assert not d.minimum_met(1, 8, rules)


# ---- skipping a full look when counts say nothing changed ------------------------------
LAST = d.LastLook(number=5, joined=3, departures=1, min_met=True, recheck_at=10.0)
EIGHT = d.RoundRules(min_nodes=2, max_nodes=8)


@pytest.mark.parametrize("last, number, joined, live, departures, now, expected", [
    (None, 5, 3, 6, 1, 0.0, None),                 # never looked
    (LAST, 6, 3, 6, 1, 0.0, None),                 # another round
    (LAST, 5, 3, 6, 1, 9.5, 0.5),                  # nothing changed: wait the timer out
    (LAST, 5, 4, 6, 1, 0.0, 1.0),                  # one more joined, minimum already met
    (LAST, 5, 3, 6, 1, 10.0, None),                # a timer ran out
    (LAST, 5, 3, 6, 2, 0.0, None),                 # a node left
    (LAST, 5, 6, 6, 1, 0.0, None),                 # every live node joined
    (LAST, 5, 8, 9, 1, 0.0, None),                 # --max-nodes (8) reached
    (d.LastLook(5, 1, 1, False, 10.0), 5, 2, 6, 1, 0.0, None),  # the minimum may be met now
])
def test_wait_without_looking_table(last, number, joined, live, departures, now, expected):
    wait = d.wait_without_looking(last, number, joined, live, departures, now, EIGHT)
    assert wait == (None if expected is None else pytest.approx(expected))


def test_wait_without_looking_does_not_count_live_suspects_as_awaited():
    """Five of six live nodes joined; the sixth is a suspect no round waits for: look
    now (before, the agent waited for the next timer: the drain timeout or its lease)."""
    assert d.wait_without_looking(LAST, 5, 5, 6, 1, 0.0, EIGHT, suspects=1) is None
    assert d.wait_without_looking(LAST, 5, 5, 6, 1, 0.0, EIGHT) == pytest.approx(1.0)


# ---- the restart budget ---------------------------------------------------------------
def test_restart_verdict_examples():
    before = plan([("a", 1), ("b", 1)], restarts=1)
    assert d.restart_verdict(None, True, ("a",), 0) == d.RestartVerdict(0, False)
    assert d.restart_verdict(before, False, ("a", "b"), 1) == d.RestartVerdict(1, False)
    assert d.restart_verdict(before, True, ("a", "b"), 2) == d.RestartVerdict(2, False)
    assert d.restart_verdict(before, True, ("a", "b"), 1) == d.RestartVerdict(2, True)
    assert d.restart_verdict(before, True, ("a",), 1) == d.RestartVerdict(1, False)  # b lost
    over = plan([("a", 1)], restarts=5)  # written by an agent with a higher limit
    assert d.restart_verdict(over, False, ("a",), 1) == d.RestartVerdict(5, False)


ROUNDS = st.lists(st.tuples(st.booleans(), st.booleans()), max_size=30)  # (failed, lost)


@PROPS
@given(ROUNDS, st.integers(0, 5))
def test_the_restart_budget_is_never_exceeded_and_losses_do_not_spend_it(rounds, max_restarts):
    current, spent = plan([("a", 1), ("b", 1)]), 0
    for failed, lost in rounds:
        members = ("a",) if lost else ("a", "b")
        verdict = d.restart_verdict(current, failed, members, max_restarts)
        counted = failed and not lost
        spent += counted
        assert verdict.restart_count == spent
        if verdict.exhausted:
            assert counted and spent == max_restarts + 1
            return  # the job failed: no plan carries the count
        assert verdict.restart_count <= max_restarts
        current = plan([("a", 1), ("b", 1)], restarts=verdict.restart_count)
    assert spent <= max_restarts


# ---- does the plan still hold ----------------------------------------------------------
@pytest.mark.parametrize("state, lease_lost, change", [
    (p.RoundState(3, p.CLOSED), True, p.Cause(K.LEASE_EXPIRED)),
    (None, False, p.Cause(K.OTHER, "round key deleted")),
    (p.RoundState(4, p.OPEN, "member-lost: b"), False, p.Cause.member_lost(["b"])),
    (p.RoundState(4, p.OPEN, "round 4 opened (newcomer)"), False, p.Cause(K.NEWCOMER)),
    (p.RoundState(4, p.OPEN, "member-suspected: a: nccl timeout"), False,
     p.Cause.member_suspected("a", "nccl timeout")),
    (p.RoundState(3, p.FAILED, "worker-failure"), False, p.Cause(K.JOB_FAILED)),
    (p.RoundState(3, p.FINISHED), False, d.Watch.HOLDS),
    (p.RoundState(3, p.CLOSED), False, d.Watch.MEMBERS),
])
def test_plan_change_table(state, lease_lost, change):
    assert d.plan_change(3, state, lease_lost) == change


def test_lost_members_keep_plan_order():
    current = plan([("a", 1), ("b", 1), ("c", 1)])
    assert d.lost_members(current, ["b", "x"]) == ("a", "c")
    assert d.lost_members(current, {"a", "b", "c"}) == ()



@pytest.mark.parametrize("state, waits", [
    (p.RoundState(4, p.OPEN, "newcomer"), True),
    (p.RoundState(4, p.OPEN, "newcomer: d"), True),   # an outsider opened it
    (p.RoundState(4, p.OPEN, "member-lost: b"), False),
    (p.RoundState(4, p.CLOSED, "newcomer"), False),   # closed: its plan decides
    (p.RoundState(5, p.OPEN, "newcomer"), False),     # not the round after ours
    (p.RoundState(3, p.CLOSED), False),
    (None, False),
])
def test_newcomers_wait_only_in_the_open_round_right_after_the_plan(state, waits):
    assert d.newcomers_wait_after(3, state) is waits


def test_a_member_is_gone_once_its_key_is_missing_or_younger_than_the_plan():
    current = plan([("a", 1), ("b", 1), ("c", 1), ("d", 1)])
    created = {"a": 10, "b": 0, "c": 57, "d": 49}  # the plan key was created at 50
    assert d.gone_since_plan(current.node_ids, created, 50) == ("b", "c")  # b: no key; c: new agent
    assert d.gone_since_plan(current.node_ids, {"a": 1, "b": 2, "c": 3, "d": 50}, 50) == ()
    assert d.gone_since_plan(current.node_ids, {"a": 1}, 50) == ("b", "c", "d")

def test_decisions_import_only_the_protocol():
    """Like protocol.py, the decisions stay pure: no etcd, no clocks of the engine."""
    source = Path(d.__file__).read_text()
    imported = {node.module for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.Import) for alias in node.names}
    project = {name for name in imported if name.startswith("elastic_runner")}
    assert project == {"elastic_runner.rendezvous"}  # `from ... import protocol as p`
    assert not imported & {"time", "threading", "socket", "os"}
