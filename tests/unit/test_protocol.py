"""Unit and property tests of the pure rendezvous rules (no I/O)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_runner.rendezvous import decisions as d
from elastic_runner import ids
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.ranks import assign_ranks, build_plan, rank_order

PROPS = settings(max_examples=200, deadline=None)

NODE_IDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=8)


def joiner(node_id: str, revision: int = 0, nproc: int = 1, addr: str | None = None,
           port: int = 29500) -> p.Joiner:
    return p.Joiner(node_id, addr or f"10.0.0.{abs(hash(node_id)) % 250 + 1}", port, nproc,
                    revision)


# ---- rank_order -----------------------------------------------------------------
def test_rank_order_survivors_keep_order_newcomers_follow_by_revision():
    previous = ("c", "a", "b")
    joiners = [joiner("a", 5), joiner("new2", 9), joiner("b", 1), joiner("new1", 7),
               joiner("c", 30)]
    ordered = rank_order(previous, joiners)
    assert [j.node_id for j in ordered] == ["c", "a", "b", "new1", "new2"]


def test_rank_order_first_round_orders_by_join_revision():
    joiners = [joiner("x", 3), joiner("y", 1), joiner("z", 2)]
    assert [j.node_id for j in rank_order((), joiners)] == ["y", "z", "x"]


def test_rank_order_lost_member_leaves_no_gap():
    ordered = rank_order(("a", "b", "c"), [joiner("c", 1), joiner("a", 2)])
    assert [j.node_id for j in ordered] == ["a", "c"]


@st.composite
def membership_change(draw):
    previous = draw(st.lists(NODE_IDS, unique=True, max_size=10))
    survivors = [n for n in previous if draw(st.booleans())]
    newcomers = draw(st.lists(NODE_IDS.filter(lambda n: n not in previous), unique=True,
                              max_size=10))
    revisions = draw(st.lists(st.integers(min_value=1, max_value=10_000), unique=True,
                              min_size=len(survivors) + len(newcomers),
                              max_size=len(survivors) + len(newcomers)))
    joiners = [joiner(n, r) for n, r in zip(survivors + newcomers, revisions)]
    shuffled = draw(st.permutations(joiners))
    return tuple(previous), survivors, newcomers, list(shuffled)


@PROPS
@given(membership_change())
def test_rank_order_property(change):
    previous, survivors, newcomers, joiners = change
    ordered = rank_order(previous, joiners)
    ids = [j.node_id for j in ordered]
    # a permutation of the joiners, nothing added or dropped
    assert sorted(ids) == sorted(j.node_id for j in joiners)
    assert sorted(ordered, key=lambda j: j.node_id) == sorted(joiners, key=lambda j: j.node_id)
    # survivors first, in their previous relative order
    assert ids[:len(survivors)] == [n for n in previous if n in survivors]
    # newcomers after, by join revision
    tail = ordered[len(survivors):]
    assert {j.node_id for j in tail} == set(newcomers)
    assert [j.join_revision for j in tail] == sorted(j.join_revision for j in tail)


# ---- build_plan -----------------------------------------------------------------
def test_build_plan_mixed_nproc_blocks_and_master():
    ordered = [joiner("a", 1, nproc=2, addr="10.0.0.1", port=1111),
               joiner("b", 2, nproc=1, addr="10.0.0.2", port=2222),
               joiner("c", 3, nproc=4, addr="10.0.0.3", port=3333)]
    plan = build_plan(7, ordered, max_nodes=8, restart_count=2, cause="failure")
    assert plan.round == 7
    assert plan.restart_count == 2 and plan.cause == "failure"
    assert plan.node_ids == ("a", "b", "c")
    assert [(m.node_rank, m.first_rank, m.nproc) for m in plan.members] == [
        (0, 0, 2), (1, 2, 1), (2, 3, 4)]
    assert plan.world_size == 7
    assert (plan.master_addr, plan.master_port) == ("10.0.0.1", 1111)
    assert plan.member("b").addr == "10.0.0.2"
    assert plan.member("zzz") is None


def test_build_plan_caps_at_max_nodes():
    ordered = [joiner(n, i) for i, n in enumerate("abcde")]
    plan = build_plan(0, ordered, max_nodes=3, restart_count=0, cause="start")
    assert plan.node_ids == ("a", "b", "c")
    assert plan.world_size == 3


@PROPS
@given(
    st.lists(st.tuples(NODE_IDS, st.integers(min_value=1, max_value=8)), min_size=1,
             max_size=12, unique_by=lambda t: t[0]),
    st.integers(min_value=1, max_value=15),
    st.integers(min_value=0, max_value=1000),
    st.integers(min_value=0, max_value=50),
)
def test_build_plan_property(nodes, max_nodes, number, restarts):
    ordered = [p.Joiner(n, f"host-{n}", 20000 + i, nproc, i) for i, (n, nproc) in
               enumerate(nodes)]
    plan = build_plan(number, ordered, max_nodes, restarts, "start")
    expected = ordered[:max_nodes]
    assert len(plan.members) == min(len(ordered), max_nodes)
    assert plan.node_ids == tuple(j.node_id for j in expected)
    assert [m.node_rank for m in plan.members] == list(range(len(expected)))
    assert [m.nproc for m in plan.members] == [j.nproc for j in expected]
    assert plan.world_size == sum(j.nproc for j in expected)
    # global ranks: contiguous blocks covering 0..W-1 exactly once, in node-rank order
    ranks = [r for m in plan.members for r in range(m.first_rank, m.first_rank + m.nproc)]
    assert ranks == list(range(plan.world_size))
    assert (plan.master_addr, plan.master_port) == (expected[0].addr, expected[0].port)
    assert plan.members[0].node_rank == 0
    assert plan.round == number and plan.restart_count == restarts


# ---- assign_ranks ---------------------------------------------------------------
@PROPS
@given(st.lists(st.integers(min_value=1, max_value=8), min_size=1, max_size=10))
def test_assign_ranks_property(nprocs):
    ordered = [p.Joiner(f"n{i}", f"h{i}", 1000 + i, nproc, i) for i, nproc in enumerate(nprocs)]
    plan = build_plan(3, ordered, len(ordered), 0, "start")
    world = sum(nprocs)
    all_ranks = []
    for member in plan.members:
        assignments = assign_ranks(plan, member.node_id)
        assert [a.local_rank for a in assignments] == list(range(member.nproc))
        assert [a.rank for a in assignments] == [member.first_rank + a.local_rank
                                                 for a in assignments]
        for a in assignments:
            assert a.world_size == world
            assert a.local_world_size == member.nproc
            assert a.group_rank == member.node_rank
            assert a.group_world_size == len(nprocs)
        all_ranks.extend(a.rank for a in assignments)
    assert sorted(all_ranks) == list(range(world))
    assert assign_ranks(plan, "not-in-plan") == []


def test_assign_ranks_standby_gets_nothing():
    ordered = [joiner("a", 1, nproc=2), joiner("b", 2, nproc=2), joiner("standby", 3)]
    plan = build_plan(0, ordered, max_nodes=2, restart_count=0, cause="start")
    assert assign_ranks(plan, "standby") == []
    assert [a.rank for a in assign_ranks(plan, "b")] == [2, 3]


# ---- may_close ------------------------------------------------------------------
def close(joined, min_nodes=2, max_nodes=4, all_live=False, first=True, settle=False):
    return p.may_close(p.CloseInputs(joined, min_nodes, max_nodes, all_live, first, settle))


@pytest.mark.parametrize("inputs, expected", [
    # below min never closes, whatever else holds
    (dict(joined=0), False),
    (dict(joined=1, settle=True), False),
    (dict(joined=1, all_live=True, first=False), False),
    (dict(joined=1, all_live=True, first=False, settle=True), False),
    (dict(joined=2, min_nodes=3, max_nodes=2, settle=True), False),
    # max reached closes at once
    (dict(joined=4), True),
    (dict(joined=5), True),
    (dict(joined=2, min_nodes=2, max_nodes=2), True),
    # min met, waiting for the settle time
    (dict(joined=2), False),
    (dict(joined=3), False),
    (dict(joined=2, settle=True), True),
    (dict(joined=3, settle=True, first=False), True),
    # every live node joined: closes only after the first round
    (dict(joined=2, all_live=True, first=False), True),
    (dict(joined=3, all_live=True, first=True), False),
    (dict(joined=3, all_live=False, first=False), False),
], ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_may_close_table(inputs, expected):
    assert close(**inputs) is expected


@PROPS
@given(st.integers(0, 10), st.integers(1, 10), st.integers(1, 10), st.booleans(),
       st.booleans(), st.booleans())
def test_may_close_never_below_min(joined, min_nodes, span, all_live, first, settle):
    result = p.may_close(p.CloseInputs(joined, min_nodes, min_nodes + span - 1, all_live,
                                       first, settle))
    if joined < min_nodes:
        assert result is False
    elif joined >= min_nodes + span - 1 or settle:
        assert result is True


# ---- counts_as_restart ----------------------------------------------------------
@pytest.mark.parametrize("failed, previous, members, expected", [
    (True, ("a", "b"), ("a", "b"), True),
    (True, ("a", "b"), ("b", "a", "c"), True),  # a newcomer does not excuse a failure
    (True, (), ("a",), True),
    (True, ("a", "b"), ("a",), False),  # a member vanished: membership change
    (True, ("a", "b"), ("a", "c"), False),
    (False, ("a", "b"), ("a", "b"), False),
    (False, ("a", "b"), ("a",), False),
    (False, (), (), False),
])
def test_counts_as_restart(failed, previous, members, expected):
    assert p.counts_as_restart(failed, previous, members) is expected


# ---- JSON round trips -----------------------------------------------------------
def test_plan_json_round_trip():
    ordered = [joiner("a", 1, nproc=2, addr="10.0.0.1", port=4000),
               joiner("b", 2, nproc=3, addr="10.0.0.2")]
    plan = build_plan(4, ordered, 4, 1, "scale-up")
    raw = plan.to_json()
    assert json.loads(raw)["world_size"] == 5
    back = p.Plan.from_json(raw)
    assert back == plan
    assert all(isinstance(m, p.Member) for m in back.members) and len(back.members) == 2
    assert back.members == tuple(plan.members) and back.member("b").first_rank == 2
    assert "round 4" in plan.describe() and "a=ranks 0..1" in plan.describe()


@PROPS
@given(st.lists(st.tuples(NODE_IDS, st.integers(1, 8)), min_size=1, max_size=6,
                unique_by=lambda t: t[0]),
       st.integers(0, 100), st.integers(0, 10), st.text(max_size=10))
def test_plan_json_round_trip_property(nodes, number, restarts, cause):
    ordered = [p.Joiner(n, f"h-{n}", 100 + i, k, i) for i, (n, k) in enumerate(nodes)]
    plan = build_plan(number, ordered, len(ordered), restarts, cause)
    assert p.Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("state", [
    p.RoundState(0, p.OPEN),
    p.RoundState(3, p.CLOSED, "failure", "rank 2 exited 1"),
    p.RoundState(9, p.FINISHED, "done", ""),
    p.RoundState(1, p.FAILED, "max-restarts", "ünïcode"),
])
def test_round_state_json_round_trip(state):
    assert p.RoundState.from_json(state.to_json()) == state


def test_job_spec_json_round_trip():
    spec = p.JobSpec(1, 4, "abcdef0123456789", 2, 8)
    assert p.JobSpec.from_json(spec.to_json()) == spec


def test_joiner_json_round_trip_revision_from_store():
    j = p.Joiner("node-1", "10.1.2.3", 29400, 4, join_revision=0)
    raw = j.to_json()
    assert "join_revision" not in json.loads(raw)
    back = p.Joiner.from_json(raw, join_revision=42)
    assert back == p.Joiner("node-1", "10.1.2.3", 29400, 4, 42)


# ---- spec_conflict --------------------------------------------------------------
def test_spec_conflict_none_when_equal():
    assert p.spec_conflict(p.JobSpec(1, 2, "f"), p.JobSpec(1, 2, "f")) is None


@pytest.mark.parametrize("mine, fields", [
    (p.JobSpec(2, 2, "f"), {"min_nodes"}),
    (p.JobSpec(1, 3, "f"), {"max_nodes"}),
    (p.JobSpec(1, 2, "f", max_workers=8), {"max_workers"}),
    (p.JobSpec(1, 2, "g"), {"fingerprint"}),
    (p.JobSpec(2, 3, "g", 4), {"min_nodes", "max_nodes", "min_workers", "fingerprint"}),
])
def test_spec_conflict_names_differing_fields(mine, fields):
    existing = p.JobSpec(1, 2, "f")
    text = p.spec_conflict(existing, mine)
    assert text is not None
    for name in ("min_nodes", "max_nodes", "min_workers", "max_workers", "fingerprint"):
        assert (name in text) is (name in fields), (name, text)
    if "nproc" in fields:
        assert "1" in text and str(mine.nproc) in text


# ---- key names ------------------------------------------------------------------
def test_key_names_prefixed_and_distinct():
    prefix = "/elastic-runner/v2/job/"
    keys = [
        p.spec_key(prefix), p.round_key(prefix), p.nodes_prefix(prefix),
        p.node_key(prefix, "a"), p.node_key(prefix, "b"),
        p.join_prefix(prefix, 0), p.join_prefix(prefix, 1),
        p.join_key(prefix, 0, "a"), p.join_key(prefix, 0, "b"), p.join_key(prefix, 1, "a"),
        p.plan_key(prefix, 0), p.plan_key(prefix, 1),
        p.failure_key(prefix, 0), p.failure_key(prefix, 1),
        p.checkpoint_key(prefix),
    ]
    assert all(k.startswith(prefix) for k in keys)
    assert len(set(keys)) == len(keys)
    assert p.node_key(prefix, "a").startswith(p.nodes_prefix(prefix))
    assert p.join_key(prefix, 3, "a").startswith(p.join_prefix(prefix, 3))
    assert p.node_id_from_key(p.node_key(prefix, "host-12")) == "host-12"
    assert p.node_id_from_key(p.join_key(prefix, 5, "host-12")) == "host-12"


@PROPS
@given(st.integers(0, 10**6), st.integers(0, 10**6), NODE_IDS, NODE_IDS)
def test_round_keys_differ_per_round_and_node(r1, r2, n1, n2):
    prefix = "/elastic-runner/v2/run/"
    for make in (p.plan_key, p.failure_key, p.join_prefix):
        assert make(prefix, r1).startswith(prefix)
        assert (make(prefix, r1) == make(prefix, r2)) is (r1 == r2)
    assert (p.join_key(prefix, r1, n1) == p.join_key(prefix, r2, n2)) is (r1 == r2 and n1 == n2)
    assert (p.node_key(prefix, n1) == p.node_key(prefix, n2)) is (n1 == n2)


# ---- settle_remaining / newcomer_wait ---------------------------------------------
@pytest.mark.parametrize("now, last_arrival, live_unjoined, expected", [
    (10.0, 0.0, False, 2.0),     # minimum met at 10, nobody since: settle from then
    (12.0, 0.0, False, 0.0),     # ... and it has passed
    (12.0, 11.5, False, 1.5),    # an arrival at 11.5 restarts the quiet period
    (12.0, 11.5, True, 28.0),    # a registered node has not joined: wait for it, to the cap
    (39.0, 38.9, False, 1.0),    # arrivals keep coming: the cap at 10 + 30 still holds
    (41.0, 40.5, False, -1.0),
    (41.0, 0.0, True, -1.0),     # a node that never joins holds the round only to the cap
])
def test_settle_remaining_table(now, last_arrival, live_unjoined, expected):
    left = d.settle_remaining(now, 10.0, last_arrival, 2.0, 30.0, live_unjoined)
    assert left == pytest.approx(expected)


@PROPS
@given(st.floats(0, 100), st.floats(0, 100), st.floats(0, 100), st.floats(0.1, 10),
       st.floats(0, 60), st.booleans())
def test_settle_never_runs_past_the_cap(min_met, last_arrival, elapsed, settle, extra,
                                        live_unjoined):
    settle_max = settle + extra
    now = min_met + elapsed
    left = d.settle_remaining(now, min_met, last_arrival, settle, settle_max, live_unjoined)
    assert now + left <= min_met + settle_max + 1e-9
    if not live_unjoined and last_arrival <= min_met:
        assert now + left == pytest.approx(min_met + min(settle, settle_max))


def test_a_newcomer_alone_opens_at_once_a_burst_waits_for_quiet():
    assert d.newcomer_wait(100.0, 99.0, [], 2.0, 30.0) == 0.0
    assert d.newcomer_wait(100.0, 99.0, [10.0, 20.0], 2.0, 30.0) == 0.0  # members from long ago
    assert d.newcomer_wait(100.0, 99.0, [99.5], 2.0, 30.0) == pytest.approx(1.5)
    # a steady stream of arrivals: bounded by --settle-max after our own registration
    assert d.newcomer_wait(128.0, 99.0, [127.9], 2.0, 30.0) == pytest.approx(1.0)
    assert d.newcomer_wait(130.0, 99.0, [129.9], 2.0, 30.0) == 0.0


# ---- members_open_wait: the plan's first member opens a round for newcomers -------
def test_a_member_opens_at_once_for_a_lone_newcomer_and_waits_out_a_burst():
    old = {"m0": 10.0, "m1": 12.0}
    assert d.members_open_wait(100.0, old, [], 2.0, 30.0) is None  # nobody waits
    assert d.members_open_wait(100.0, {**old, "n": 99.5}, ["n"], 2.0, 30.0) == 0.0
    burst = {**old, "n1": 99.0, "n2": 99.5}
    # n2's own rule comes due first: quiet for --settle since the arrival before it
    assert d.members_open_wait(100.0, burst, ["n1", "n2"], 2.0, 30.0) == pytest.approx(1.0)
    # arrivals keep coming: the earliest waiting node's --settle-max still bounds it
    stream = {**old, "n1": 99.0, "n2": 127.5, "n3": 127.9}
    assert d.members_open_wait(128.0, stream, ["n1", "n2", "n3"], 2.0, 30.0) == \
        pytest.approx(1.0)


@PROPS
@given(st.dictionaries(NODE_IDS, st.floats(0, 100), min_size=1, max_size=8), st.data(),
       st.floats(0, 120), st.floats(0.1, 10), st.floats(0, 60))
def test_members_open_wait_is_the_soonest_newcomer_rule(registered, data, now, settle, extra):
    waiting = data.draw(st.lists(st.sampled_from(sorted(registered)), min_size=1, unique=True))
    settle_max = settle + extra
    wait = d.members_open_wait(now, registered, waiting, settle, settle_max)
    each = [d.newcomer_wait(now, registered[node],
                            [at for other, at in registered.items() if other != node],
                            settle, settle_max) for node in waiting]
    assert wait == pytest.approx(min(each))
    assert 0.0 <= wait <= max(0.0, min(registered[n] for n in waiting) + settle_max - now) + 1e-9


def test_the_key_layout_parses_only_its_own_keys():
    assert p.run_prefix("job7") == "/elastic-runner/v2/job7/"
    assert p.split_run_key("/elastic-runner/v2/job7/rounds/3/plan") == ("job7", "rounds/3/plan")
    assert p.split_run_key("/elastic-runner/v0/job7/round") is None
    assert p.split_run_key("/elastic-runner/v2/job7") is None
    assert p.round_of("rounds/12/join/a") == 12
    assert p.round_of("rounds/x/plan") is None and p.round_of("nodes/a") is None
    assert p.round_of("rounds/3") is None


@PROPS
@given(st.from_regex(ids.ID_GRAMMAR, fullmatch=True), st.from_regex(ids.ID_GRAMMAR, fullmatch=True))
def test_no_valid_run_id_has_its_keys_under_another_runs_prefix(a, b):
    """Ids cannot contain '/', so one run's prefix never holds another run's keys."""
    if a != b and ids.id_problem(a) is None and ids.id_problem(b) is None:
        assert not p.node_key(p.run_prefix(a), "n").startswith(p.run_prefix(b))


@pytest.mark.parametrize("run_id", ["job", "store", "events", "rounds"])
def test_only_the_store_and_the_event_log_are_passive_whatever_the_run_id(run_id):
    """A run id is a key segment: one named like a passive folder must not make the
    mirror ignore the run's deciding keys (it would never see a node or a round)."""
    prefix = p.run_prefix(run_id)
    deciding = [p.round_key(prefix), p.node_key(prefix, "store"), p.plan_key(prefix, 3),
                p.join_key(prefix, 3, "events"), p.notice_key(prefix, "n1"),
                p.checkpoint_key(prefix), p.spec_key(prefix)]
    passive = [p.store_prefix(prefix, 3) + "k", p.event_key(prefix, 12, "n1")]
    assert [key for key in deciding if p.is_passive_key(key)] == []
    assert all(p.is_passive_key(key) for key in passive)


# ---- the protocol number in the spec ------------------------------------------------
def test_the_spec_carries_the_protocol_in_the_fingerprint_older_agents_compare():
    raw = json.loads(p.JobSpec(1, 4, "abcdef0123456789").to_json())
    assert raw["fingerprint"] == f"abcdef0123456789+protocol-{p.RUN_PROTOCOL}"
    assert "protocol" not in raw  # an older agent's JobSpec(**fields) takes every field


def test_a_spec_an_older_release_wrote_is_protocol_1_and_refused_with_one_line():
    older = json.dumps({"min_nodes": 1, "max_nodes": 4, "fingerprint": "abcdef0123456789",
                        "min_workers": 0, "max_workers": 0}).encode()
    existing = p.JobSpec.from_json(older)
    assert (existing.fingerprint, existing.protocol) == ("abcdef0123456789", 1)
    text = p.spec_conflict(existing, p.JobSpec(1, 4, "abcdef0123456789"))
    assert text == (f"elastic-runner protocol 1 (run) vs {p.RUN_PROTOCOL} (this node): run one "
                    "elastic-runner version on every node of a run")


def test_a_run_of_protocol_2_refuses_a_node_whose_workers_form_groups_per_round():
    """Protocol 3 keeps a round's group keys under default_pg/round-N: a protocol-2
    worker and a protocol-3 one in one round would each wait for the other's keys."""
    older = p.JobSpec(1, 4, "abcdef0123456789", protocol=2)
    assert p.RUN_PROTOCOL == 3
    assert p.spec_conflict(p.JobSpec.from_json(older.to_json()),
                           p.JobSpec(1, 4, "abcdef0123456789")) == (
        "elastic-runner protocol 2 (run) vs 3 (this node): run one elastic-runner version "
        "on every node of a run")
