"""Suspicion against a real etcd (issue 15): a survivor's failed collective opens the
next round at once, and the round does not wait for the dead node's lease. Also how
a member's loss is seen when its id is registered again at once (a stall just past
the lease, an agent restarted by a supervisor).

A SIGKILLed node is simulated by a node that stops taking part (its agent loop
ends) while its lease is kept alive and is long (30 s): lease expiry can never
be what drops it. Tests wait on outcomes with deadlines, never on sleeps, and
assert rounds and members, not times.
"""

from __future__ import annotations

import threading
import time

import pytest

from elastic_runner.config import EtcdConfig, RendezvousConfig
from elastic_runner.errors import RunFinished, SpecMismatch
from elastic_runner.etcd.client import Delete, EtcdClient, Get
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.engine import EtcdRendezvous

LEASE_TTL_S = 30  # far beyond every wait below: a lease never expires in these tests


class Agent:
    """One node's rendezvous loop without workers (as the agent runs it): take a plan,
    watch it, join the next round when it stops holding. `hang()` ends the loop
    without leaving (the node is silent, its key stays); `resume()` starts it again
    from the last plan it held."""

    def __init__(self, endpoint: str, run_id: str, node_id: str, **overrides):
        self.client = EtcdClient(EtcdConfig((endpoint,), timeout_s=5.0, retry_deadline_s=10.0))
        config = RendezvousConfig(run_id, node_id, **{
            "min_nodes": 2, "max_nodes": 3, "lease_ttl_s": LEASE_TTL_S, "settle_s": 0.5,
            "join_timeout_s": 60, **overrides})
        self.rdzv = EtcdRendezvous(self.client, config,
                                   p.JobSpec(config.min_nodes, config.max_nodes, "test"), 0)
        self.plans: list[p.Plan] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def plan(self) -> p.Plan | None:
        return self.plans[-1] if self.plans else None

    def start(self) -> "Agent":
        self.rdzv.register()
        return self._run(None)

    def hang(self) -> None:
        self._stop.set()
        self.rdzv.mirror.wake()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()
        self._stop.clear()

    def resume(self) -> "Agent":
        return self._run(self.plan)

    def _run(self, plan: p.Plan | None) -> "Agent":
        self._thread = threading.Thread(target=self._loop, args=(plan,), daemon=True)
        self._thread.start()
        return self

    def _loop(self, plan: p.Plan | None) -> None:
        try:
            if plan is None:
                plan = self._take(self.rdzv.next_plan(None, p.Cause(p.CauseKind.START)))
            while not self._stop.is_set():
                generation = self.rdzv.mirror.generation
                reason = self.rdzv.change_reason(plan)
                if reason is not None:
                    plan = self._take(self.rdzv.next_plan(plan, reason))
                else:
                    self.rdzv.mirror.wait(0.1, generation)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            if not self._stop.is_set():
                self.error = exc

    def _take(self, plan: p.Plan) -> p.Plan:
        self.plans.append(plan)
        return plan

    def close(self) -> None:
        self._stop.set()
        self.rdzv.shutdown.set()
        self.rdzv.mirror.wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.rdzv.leave()
        self.client.close()


@pytest.fixture
def agents(etcd):
    made: list[Agent] = []

    def start(run: str, *node_ids: str, **overrides) -> list[Agent]:
        new = [Agent(etcd.endpoint, run, node_id, **overrides) for node_id in node_ids]
        made.extend(new)
        for agent in new:
            agent.start()
        return new

    yield start
    for agent in made:
        agent.close()


def held_by_all(agents: list[Agent], number: int, timeout_s: float = 30) -> p.Plan:
    """The plan of round `number` once every agent holds it (each its newest)."""
    deadline = time.monotonic() + timeout_s
    while True:
        errors = [agent.error for agent in agents if agent.error]
        assert not errors, errors
        plans = [agent.plan for agent in agents]
        if all(plan is not None and plan.round == number for plan in plans):
            assert len({plan.to_json() for plan in plans}) == 1  # one plan, not several
            return plans[0]
        history = [[(plan.round, plan.node_ids, plan.cause) for plan in agent.plans]
                   for agent in agents]
        assert time.monotonic() < deadline, f"no agreement on round {number}: {history}"
        time.sleep(0.02)


def suspicion(observer: Agent) -> p.Cause:
    return p.Cause.member_suspected(f"{observer.rdzv.node_id} rank 0", "allreduce timed out")


def test_a_silent_member_is_left_out_after_the_grace_and_gets_back_in(agents):
    a, b, c = agents("silent", "a", "b", "c")
    start = held_by_all([a, b, c], 0)
    assert set(start.node_ids) == {"a", "b", "c"}  # in the order they joined
    survivors = tuple(node for node in start.node_ids if node != "c")
    c.hang()  # as if SIGKILLed: no more joins, but its lease (30 s) lives on
    a.rdzv.suspect(start, suspicion(a))
    b.rdzv.suspect(start, suspicion(b))  # a second survivor's evidence opens nothing more
    shrunk = held_by_all([a, b], 1)
    assert shrunk.node_ids == survivors  # survivors keep their order
    assert shrunk.world_size == 2 and shrunk.restart_count == 0
    assert p.Cause.parse(shrunk.cause).kind is p.CauseKind.MEMBER_SUSPECTED
    assert c.rdzv.mirror.get(p.node_key(c.rdzv.prefix, "c")) is not None  # no lease expired
    # The first member opens no round for c while c is silent: its key may be a dead
    # node's, waiting for its lease, and such a round would wait for it.
    first = {"a": a, "b": b}[shrunk.node_ids[0]]
    assert first.rdzv.newcomers.members_wait(shrunk) is None
    assert a.rdzv.current_round().state.number == 1
    # c was only slow: it finds itself outside the plan and gets back in.
    c.resume()
    grown = held_by_all([a, b, c], 2)
    assert grown.node_ids == (*survivors, "c")
    assert p.Cause.parse(grown.cause).kind is p.CauseKind.NEWCOMER
    assert grown.restart_count == 0


def test_the_round_a_left_out_member_opens_waits_for_it(agents):
    """Opening a round and joining it are two writes. c, left out on suspicion, opens
    round 2; a and b join it before c does (on a loaded 2-core CI machine they did).
    Round 2 must wait for c, not close with a and b alone and leave c to open a
    third round that re-forms the job again."""
    a, b, c = agents("opener", "a", "b", "c")
    start = held_by_all([a, b, c], 0)
    c.hang()
    a.rdzv.suspect(start, suspicion(a))
    shrunk = held_by_all([a, b], 1)
    assert c.rdzv.open_next(c.rdzv.current_round(), p.Cause.newcomer("c"))  # c's open, no join
    joins = p.join_prefix(a.rdzv.prefix, 2)
    deadline = time.monotonic() + 30
    while {p.node_id_from_key(kv.key) for kv in a.rdzv.mirror.children(joins)} != {"a", "b"}:
        assert time.monotonic() < deadline, "a and b never joined round 2"
        time.sleep(0.02)
    held_open = time.monotonic() + 1.0  # far past the moment a closer acts on a full join
    while time.monotonic() < held_open:
        assert a.rdzv.plan(2) is None, "round 2 closed without the node that opened it"
        time.sleep(0.02)
    c.resume()  # its join
    grown = held_by_all([a, b, c], 2)
    assert grown.node_ids == (*shrunk.node_ids, "c")
    assert p.Cause.parse(grown.cause) == p.Cause.newcomer("c")


def test_a_read_under_the_round_asks_about_hundreds_of_members_at_once(agents):
    """A mass loss (a zone's spot nodes reclaimed together) asks etcd about every lost
    member under one guard, the round key's revision (`_confirm_gone`). etcd refuses
    a transaction of more than 128 operations, so 300 reads went as one error; now
    they go in chunks under the same guard, and a round that moved still answers None."""
    a, b = agents("mass", "a", "b")
    start = held_by_all([a, b], 0)
    seen = a.rdzv.current_round()
    ids = [f"gone-{i:03d}" for i in range(300)] + ["a", "b"]
    reads = a.rdzv._read_while_round_is(seen, [Get(p.node_key(a.rdzv.prefix, n)) for n in ids])
    assert [bool(read.kvs) for read in reads] == [False] * 300 + [True, True]
    a.rdzv.suspect(start, suspicion(a))
    held_by_all([a, b], 1)
    assert a.rdzv._read_while_round_is(seen, [Get(p.node_key(a.rdzv.prefix, n))
                                              for n in ids]) is None


def test_a_suspicion_where_everyone_is_alive_drops_nobody(agents):
    a, b, c = agents("alive", "a", "b", "c", suspect_grace_s=5.0)
    start = held_by_all([a, b, c], 0)
    a.rdzv.suspect(start, suspicion(a))
    again = held_by_all([a, b, c], 1)
    assert again.node_ids == start.node_ids and again.restart_count == 0


def test_a_suspected_round_does_not_close_below_the_minimum(agents):
    """With --min-nodes 3, the two survivors wait rather than train without c."""
    a, b, c = agents("minimum", "a", "b", "c", min_nodes=3, suspect_grace_s=0.2,
                     join_timeout_s=5)
    start = held_by_all([a, b, c], 0)
    c.hang()
    a.rdzv.suspect(start, suspicion(a))
    deadline = time.monotonic() + 30
    while not (a.error and b.error):
        assert time.monotonic() < deadline, "the survivors neither timed out nor failed"
        time.sleep(0.02)
    assert "--min-nodes 3" in str(a.error) and "--min-nodes 3" in str(b.error)
    assert a.plan.round == b.plan.round == 0
    assert a.rdzv.plan(1) is None


def test_suspect_records_only_a_suspicion(agents):
    a, b = agents("kind", "a", "b", max_nodes=2)
    start = held_by_all([a, b], 0)
    with pytest.raises(ValueError):
        a.rdzv.suspect(start, p.Cause(p.CauseKind.NEWCOMER))
    assert a.rdzv.current_round().state.number == 0


def test_a_run_is_marked_as_re_forming_in_place_once(agents, etcd):
    a, b = agents("marked", "a", "b")
    start = held_by_all([a, b], 0)
    a.rdzv.mark_in_place(start.round)
    marked = a.client.get(p.inplace_key(a.rdzv.prefix))
    assert marked is not None
    a.rdzv.mirror.wait_revision(marked.mod_revision, timeout_s=10)
    a.rdzv.mark_in_place(start.round)  # seen in its copy: no second write
    b.rdzv.mark_in_place(start.round)  # a race lost to a: create-if-absent
    assert a.client.get(p.inplace_key(a.rdzv.prefix)).mod_revision == marked.mod_revision


def test_a_node_of_a_run_that_re_forms_in_place_stands_by_before_it_registers(agents, etcd):
    """register(unless_in_place=True), as agent/standby.py asks it: one request tells
    a run's first start (register now) from a run marked as re-forming in place (start
    the workers on standby first; nothing written, the lease kept for the registration
    after), a finished run, and another job under the same run id."""
    fresh = Agent(etcd.endpoint, "not-marked", "x")
    a, b = agents("marked", "a", "b")
    start = held_by_all([a, b], 0)
    a.rdzv.mark_in_place(start.round)
    newcomer = Agent(etcd.endpoint, "marked", "c")
    stranger = Agent(etcd.endpoint, "marked", "d", max_nodes=4)  # another job's spec
    reclaimed = Agent(etcd.endpoint, "marked", "e")
    try:
        assert fresh.rdzv.register(unless_in_place=True) is True  # one run's mark is
        assert fresh.client.get(p.node_key(fresh.rdzv.prefix, "x")) is not None  # not another's
        assert newcomer.rdzv.register(unless_in_place=True) is False
        assert newcomer.client.get(p.node_key(newcomer.rdzv.prefix, "c")) is None
        kept = newcomer.rdzv.lease.id
        assert newcomer.client.lease_remaining(kept) >= 0  # kept (whole seconds: may read 0)
        with pytest.raises(SpecMismatch):  # said at once, before any worker starts
            stranger.rdzv.register(unless_in_place=True)
        assert newcomer.rdzv.register() is True
        key = newcomer.client.get(p.node_key(newcomer.rdzv.prefix, "c"))
        assert key is not None and key.lease == kept  # the lease it stood by with
        assert reclaimed.rdzv.register(unless_in_place=True) is False
        reclaimed.rdzv.leave()  # a signal while its workers got ready (agent.py)
        assert reclaimed.client.lease_remaining(reclaimed.rdzv.lease.id) <= 0
    finally:
        for agent in (fresh, newcomer, stranger, reclaimed):
            agent.close()


def test_a_lease_lost_while_standing_by_is_replaced_when_the_node_registers(agents, etcd):
    """Standby workers may take minutes to get ready (a GPU node's checkpoint), and a
    starved agent may lose the lease it kept meanwhile: it registers with a new one."""
    a, b = agents("lost-standby", "a", "b")
    a.rdzv.mark_in_place(held_by_all([a, b], 0).round)
    newcomer = Agent(etcd.endpoint, "lost-standby", "c")
    try:
        assert newcomer.rdzv.register(unless_in_place=True) is False
        kept = newcomer.rdzv.lease.id
        newcomer.client.revoke_lease(kept)  # behind the keep-alive's back
        assert newcomer.rdzv.register() is True
        key = newcomer.client.get(p.node_key(newcomer.rdzv.prefix, "c"))
        assert key is not None and key.lease == newcomer.rdzv.lease.id != kept
    finally:
        newcomer.close()


def test_a_node_of_a_finished_run_does_not_stand_by(agents, etcd):
    a, b = agents("finished", "a", "b")
    start = held_by_all([a, b], 0)
    a.rdzv.mark_in_place(start.round)
    a.rdzv.finish(start)
    late = Agent(etcd.endpoint, "finished", "c")
    try:
        assert late.rdzv.register(unless_in_place=True) is True  # nothing to join: it
        with pytest.raises(RunFinished):  # learns so at once, with no workers started
            late.rdzv.next_plan(None, p.Cause(p.CauseKind.START))
    finally:
        late.close()


def test_a_join_after_a_suspicion_does_not_wait_for_the_left_out_nodes_lease(agents):
    """c, left out on suspicion, keeps its key (its lease lives on). A newcomer's
    round soon after must close without c, not wait for it to join or expire: with
    --settle-max, the drain timeout and the lease at 120 s and room for a fourth
    node, only the memory of the suspicion lets it close within 20 s. (It once
    waited out the drain timeout: c's live key kept the joiners' count from ever
    reaching the live nodes', so nobody looked again before a timer ran out.)"""
    slow = {"settle_max_s": 120.0, "drain_timeout_s": 120.0, "lease_ttl_s": 120}
    a, b, c = agents("later", "a", "b", "c", max_nodes=4, **slow)
    start = held_by_all([a, b, c], 0)
    c.hang()
    a.rdzv.suspect(start, suspicion(a))
    shrunk = held_by_all([a, b], 1)
    assert set(shrunk.node_ids) == {"a", "b"}  # round 0's order: by join revision
    (d,) = agents("later", "d", max_nodes=4, **slow)
    grown = held_by_all([a, b, d], 2, timeout_s=20)  # far below every 120 s timer
    assert grown.node_ids == (*shrunk.node_ids, "d")
    assert p.Cause.parse(grown.cause).kind is p.CauseKind.NEWCOMER
    assert c.rdzv.mirror.get(p.node_key(c.rdzv.prefix, "c")) is not None  # still live


def test_an_agent_started_again_under_a_members_id_takes_a_new_round_not_the_old_plan(agents):
    """c's agent crashed and a supervisor started it again at once: the new agent waits
    out the dead one's lease, registers, and finds round 0's plan naming "c". That
    member was the dead agent, whose workers are gone; taking its plan would give the
    new agent ranks in a group that has no place for it. It opens a round for the
    loss itself, even while no deputy looks (a and b are stopped here)."""
    ttl = {"lease_ttl_s": 2}
    a, b, c = agents("again", "a", "b", "c", **ttl)
    start = held_by_all([a, b, c], 0)
    for agent in (a, b, c):
        agent.hang()
    c.rdzv.lease.stop()  # no keep-alive, no revoke: as after SIGKILL
    c.rdzv.mirror.stop()
    (again,) = agents("again", "c", **ttl)  # registers once the dead lease is gone
    deadline = time.monotonic() + 30
    while (seen := a.rdzv.current_round()).state.number == start.round:
        assert again.error is None and time.monotonic() < deadline, "no round opened for c"
        time.sleep(0.02)
    assert p.Cause.parse(seen.state.cause) == p.Cause.member_lost(["c"])
    assert again.plans == []  # it never took round 0's plan
    a.resume(), b.resume()
    grown = held_by_all([a, b, again], 1)
    assert set(grown.node_ids) == {"a", "b", "c"}


def test_a_deputy_sees_a_member_lost_though_its_id_registered_again(agents, etcd):
    """The dead member's key is gone and back (a new agent under its id) before any
    deputy looks. The node key alone says nothing changed; the member's join of the
    plan's round, under the dead lease, is gone for good: a deputy opens the round."""
    ttl = {"lease_ttl_s": 2}
    a, b, c = agents("seen", "a", "b", "c", **ttl)
    start = held_by_all([a, b, c], 0)
    for agent in (a, b, c):
        agent.hang()
    c.rdzv.lease.stop()  # as after SIGKILL
    c.rdzv.mirror.stop()
    again = Agent(etcd.endpoint, "seen", "c", **ttl)
    try:
        again.rdzv.register()  # its key is back; its loop does not run yet
        a.resume(), b.resume()
        deadline = time.monotonic() + 30
        while (seen := a.rdzv.current_round()).state.number == start.round:
            assert time.monotonic() < deadline, "no deputy opened a round for c"
            time.sleep(0.02)
        assert p.Cause.parse(seen.state.cause) == p.Cause.member_lost(["c"])
        again._run(None)
        grown = held_by_all([a, b, again], 1)
        assert set(grown.node_ids) == {"a", "b", "c"}
    finally:
        again.close()


def test_a_member_lost_while_a_newcomer_round_is_open_stops_the_others(agents, etcd):
    """Round 1 is open for a newcomer when c's lease goes and its id registers again
    (a stall just past the lease). A newcomer round does not stop the plan's members
    (they form its group, or train, and take the newcomer in later), so nothing told
    a and b that c's workers would never come: in a chaos soak they waited out the
    formation timeout. A deputy marks round 1 as having lost c; the round key then
    tells every member, and the round still closes, with the new c in it."""
    ttl = {"lease_ttl_s": 2, "max_nodes": 4}
    a, b, c = agents("meanwhile", "a", "b", "c", **ttl)
    start = held_by_all([a, b, c], 0)
    for agent in (a, b, c):
        agent.hang()
    assert a.rdzv.open_next(a.rdzv.current_round(), p.Cause.newcomer())
    assert a.rdzv.change_reason(start) == p.Cause.newcomer()  # all alive: only a newcomer
    planned = a.client.get(p.plan_key(a.rdzv.prefix, start.round)).create_revision
    c.rdzv.lease.stop()  # as after a stall past the lease
    c.rdzv.mirror.stop()
    again = Agent(etcd.endpoint, "meanwhile", "c", **ttl)
    try:
        again.rdzv.register()  # its key is back before any deputy looks
        key = p.node_key(a.rdzv.prefix, "c")
        deadline = time.monotonic() + 10
        while getattr(a.rdzv.mirror.get(key), "create_revision", 0) <= planned:
            assert time.monotonic() < deadline, "a's copy never showed c's new key"
            time.sleep(0.02)
        assert a.rdzv.change_reason(start) == p.Cause.member_lost(["c"])
        deadline = time.monotonic() + 10  # b's copy follows a's write a moment later
        while (seen := b.rdzv.current_round()).state.cause == "newcomer":
            assert time.monotonic() < deadline, "b's copy never showed the marked round"
            time.sleep(0.02)
        assert seen.state == p.RoundState(1, p.OPEN, "member-lost: c")  # still open
        assert b.rdzv.change_reason(start) == p.Cause.member_lost(["c"])
        a.resume(), b.resume()
        again._run(None)
        grown = held_by_all([a, b, again], 1)
        assert set(grown.node_ids) == {"a", "b", "c"}
    finally:
        again.close()


def test_whether_etcd_answers_now_is_one_question(agents):
    """The agent's grace check (agent/etcd_outage.py) asks this once a host wakes from
    a stall: a live etcd says yes; an endpoint where nothing listens says no."""
    from elastic_runner.etcd.server import free_port

    (a, _) = agents("asks", "a", "b")
    assert a.rdzv.etcd_answers_now() is True
    dead = Agent(f"http://127.0.0.1:{free_port()}", "asks", "c")
    try:
        assert dead.rdzv.etcd_answers_now() is False
    finally:
        dead.client.close()


def test_a_deleted_round_key_is_a_reason_to_stop_not_an_error(agents):
    """Someone removed the run's round key by hand (etcdctl del): every member's plan
    stops holding, with a cause that says so, also on a deputy."""
    a, b = agents("wiped", "a", "b")
    start = held_by_all([a, b], 0)
    for agent in (a, b):
        agent.hang()
    a.client.txn([], [Delete(p.round_key(a.rdzv.prefix))])
    deadline = time.monotonic() + 10
    while a.rdzv.current_round() is not None:
        assert time.monotonic() < deadline, "a's copy never showed the round key gone"
        time.sleep(0.02)
    assert a.rdzv.change_reason(start) == p.Cause(p.CauseKind.OTHER, "round key deleted")
