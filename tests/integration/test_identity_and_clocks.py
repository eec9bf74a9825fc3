"""Issue 12, items 4 and 6, against a real etcd.

Item 4: a node id is held by one live agent at a time (create-if-absent under its
lease); a second live agent with the same id is refused with DuplicateNodeId, a
crashed one's id is free once its lease runs out.

Item 6: no decision compares clocks of different machines. One agent runs with
its clocks (wall and monotonic) 60 s off, as another machine's may be; the
rendezvous must behave as if they agreed.
"""

from __future__ import annotations

import time

import pytest

from elastic_runner.errors import DuplicateNodeId, LeaseNotFound, exit_code_for
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous import registration
from elastic_runner.rendezvous.engine import EtcdRendezvous
from tests.helpers.rdzv_nodes import Engines, Node, wait_for_agreement

TTL_S = 2


# ---- item 4: one live agent per node id -------------------------------------------
@pytest.fixture
def agent(etcd):
    """Make an EtcdRendezvous (not registered yet); all are left and closed after."""
    engines = Engines(p.JobSpec(1, 4, "test"), TTL_S)
    yield lambda run, node_id: engines.make(etcd.endpoint, run, node_id)
    engines.close_all()


def holder_lease(rdzv: EtcdRendezvous) -> int | None:
    kv = rdzv._client.get(p.node_key(rdzv.prefix, rdzv.node_id))
    return kv.lease if kv else None


def test_a_live_duplicate_is_refused_and_the_id_is_free_once_its_lease_is_gone(agent):
    first = agent("dup", "a")
    first.register()
    second = agent("dup", "a")
    with pytest.raises(DuplicateNodeId) as refused:
        second.register()
    message = str(refused.value)
    assert "\n" not in message and exit_code_for(refused.value) == 2
    for part in ("node id 'a'", "run 'dup'", "addr 127.0.0.1", "pid ", "another --node-id"):
        assert part in message, message
    assert holder_lease(first) == first.lease.id  # the first agent keeps its key
    first.leave()
    third = agent("dup", "a")
    third.register()
    assert holder_lease(third) == third.lease.id


def test_a_crashed_agents_id_is_taken_over_once_its_lease_expires(agent):
    crashed = agent("crash", "a")
    crashed.register()
    crashed.lease.stop()  # no more keep-alives, no revoke: as after SIGKILL
    crashed.mirror.stop()
    successor = agent("crash", "a")
    successor.register()  # waits out the dead lease instead of failing
    assert holder_lease(successor) == successor.lease.id


def test_re_registering_after_a_lost_lease_refuses_an_id_taken_meanwhile(agent):
    first = agent("relost", "a")
    first.register()
    first._client.revoke_lease(first.lease.id)  # as if it expired during a partition
    assert first.lease.lost.wait(TTL_S * 3)
    second = agent("relost", "a")
    second.register()
    with pytest.raises(DuplicateNodeId, match="node id 'a' is already registered"):
        first.next_plan(None, p.Cause(p.CauseKind.START))
    assert holder_lease(second) == second.lease.id


def test_a_create_retried_after_a_lost_answer_finds_its_own_key(agent):
    rdzv = agent("retry", "a")
    rdzv.register()
    record = registration.node_record(rdzv._config, time.time)
    registration.claim(rdzv._client, rdzv._config, record, rdzv.lease.id)
    assert holder_lease(rdzv) == rdzv.lease.id


def lease_expires_before_the_first(times: int, monkeypatch) -> list[int]:
    """Make registration's first `times` creates find their fresh lease gone, as when
    the agent is starved of CPU past the TTL between the grant and the create.
    Both ways to the create are covered: register_node (a start, one transaction
    with the spec check) and claim (its step-by-step path, and a re-registration)."""
    leases: list[int] = []

    def revoking(real):
        def create(client, config, *rest, **options):
            lease_id = rest[-2]  # (..., record, lease_id, also) in both
            if lease_id not in leases:
                leases.append(lease_id)
                if len(leases) <= times:
                    client.revoke_lease(lease_id)
            return real(client, config, *rest, **options)
        return create
    monkeypatch.setattr(registration, "claim", revoking(registration.claim))
    monkeypatch.setattr(registration, "register_node", revoking(registration.register_node))
    return leases


def test_a_lease_gone_before_the_create_is_retried_with_a_fresh_one(agent, monkeypatch):
    leases = lease_expires_before_the_first(1, monkeypatch)
    rdzv = agent("starved", "a")
    rdzv.register()
    assert len(set(leases)) == 2 and holder_lease(rdzv) == rdzv.lease.id == leases[-1]


def test_registration_gives_up_with_a_typed_error_after_its_attempts(agent, monkeypatch):
    leases = lease_expires_before_the_first(5, monkeypatch)
    rdzv = agent("starving", "a")
    with pytest.raises(LeaseNotFound, match="--lease-ttl") as caught:
        rdzv.register()
    assert len(leases) == 2 and exit_code_for(caught.value) == 4
    assert holder_lease(rdzv) is None


# ---- item 6: decisions on each agent's own clock -----------------------------------
SETTLE_MAX_S = 30.0


def skewed(offset: float) -> dict:
    """Clocks of a machine `offset` s away from the others (monotonic origins differ too)."""
    return {"clock": lambda: time.monotonic() + offset,
            "wall_clock": lambda: time.time() + offset}


@pytest.fixture
def node(etcd):
    started: list[Node] = []

    def start(run: str, node_id: str, **options) -> Node:
        started.append(Node(etcd.endpoint, run, node_id, 8, **options).start())
        return started[-1]

    yield start
    for each in started:
        each.stop()


@pytest.mark.parametrize("offset", [60.0, -60.0])
@pytest.mark.parametrize("who", ["first member", "second member", "newcomer"])
def test_newcomers_join_in_one_round_whatever_one_clock_says(node, who, offset):
    """Measured before the fix: one member 60 s ahead held every join to --settle-max.

    Each join must be admitted by the next round, through the settle quiet (0.5 s)
    rather than the --settle-max cap (30 s): the bound checks which rule fired.
    """
    run = f"skew-{who.replace(' ', '-')}{offset:+.0f}"
    timing = {"settle_s": 0.5, "settle_max_s": SETTLE_MAX_S}

    def clocks(name: str) -> dict:
        return {**timing, **(skewed(offset) if name == who else {})}

    nodes = [node(run, "m0", **clocks("first member"))]
    plan = wait_for_agreement(nodes, 1, timeout_s=SETTLE_MAX_S)
    for name in ("second member", "newcomer"):
        arrived = time.monotonic()
        nodes.append(node(run, name.replace(" ", "-"), **clocks(name)))
        joined = wait_for_agreement(nodes, len(nodes), timeout_s=SETTLE_MAX_S)
        assert joined.round == plan.round + 1
        assert joined.members[0].node_id == "m0"  # the first member stays first
        assert nodes[-1].admitted_at[0] - arrived < SETTLE_MAX_S
        plan = joined


@pytest.mark.parametrize("offset", [60.0, -60.0])
def test_settle_counts_quiet_from_when_each_arrival_was_seen(node, offset):
    """A joiner whose clock is behind must still restart the quiet period (before the
    fix the round closed without the next arrival), and one ahead must not stretch
    it to --settle-max (60 s here, against a settle of 3 s)."""
    run = f"settle{offset:+.0f}"
    timing = {"settle_s": 3.0, "settle_max_s": 2 * SETTLE_MAX_S}
    nodes = [node(run, "a", **timing)]
    time.sleep(2.0)  # inside a's settle: b's arrival restarts the quiet period
    nodes.append(node(run, "b", **timing, **skewed(offset)))
    time.sleep(1.8)  # past a's settle, inside b's: c makes round 0 only if b counted
    nodes.append(node(run, "c", **timing))
    plan = wait_for_agreement(nodes, 3, timeout_s=SETTLE_MAX_S)
    assert plan.round == 0


def test_a_published_address_that_is_not_this_machines_gets_a_round(node):
    """Behind NAT the address the others dial (--master-addr) is none of this machine's.
    Rank 0's store listens on every interface, so its port is picked there; picking it
    on the published address failed (cannot assign requested address) and ended the
    agent in a traceback. 192.0.2.1 is a documentation address, never assigned."""
    natted = node("nat", "a", node_addr="192.0.2.1")
    plan = wait_for_agreement([natted], 1, timeout_s=30)
    assert (plan.master_addr, plan.members[0].node_id) == ("192.0.2.1", "a")
    assert 0 < plan.master_port < 65536
