"""Issue 3's scenarios: real etcd, real agents, real gloo workers on localhost."""

from __future__ import annotations

import json
import signal
import time

import pytest

pytestmark = pytest.mark.e2e


def ranks_by_node(rows: list[dict]) -> dict[str, set[tuple[int, int]]]:
    """Group (global rank, local rank) by the node's group rank."""
    nodes: dict[str, set[tuple[int, int]]] = {}
    for row in rows:
        nodes.setdefault(row["GROUP_RANK"], set()).add((int(row["RANK"]), int(row["LOCAL_RANK"])))
    return nodes


def test_a_joining_node_scales_to_world_six_then_the_rank0_host_and_one_more_leave(job):
    """a and b train as world 4; c joins: world 6, ranks contiguous per node (two local
    ranks each), every all-reduce saw all six. (Three nodes started together: see
    test_topology and the five-agent test below.) Then SIGKILL of the node hosting rank
    0: the rest re-form as world 4 on a new master port. Then SIGTERM to another: world
    2, its lease is revoked at once, and membership changes never counted as restarts."""
    job.start("a", "b")
    job.wait_world(4)
    joined_at = time.time()
    job.start("c")
    rows = job.wait_world(6, after=joined_at, timeout=30)
    assert {int(r["RANK"]) for r in rows} == set(range(6))
    print(f"join -> first step at world 6: {min(r['t'] for r in rows) - joined_at:.2f} s")
    nodes = ranks_by_node(rows)
    assert len(nodes) == 3
    for group_rank, ranks in nodes.items():
        assert {local for _, local in ranks} == {0, 1}
        assert {rank for rank, _ in ranks} == {2 * int(group_rank), 2 * int(group_rank) + 1}
    assert {r["GROUP_WORLD_SIZE"] for r in rows} == {"3"}
    assert {r["LOCAL_WORLD_SIZE"] for r in rows} == {"2"}
    assert {r["reduced"] for r in rows} == {6}  # every all-reduce saw the whole world

    host = next(r for r in rows if r["RANK"] == "0")
    victim = next(n for n in "abc" if "ranks 0..1" in _plan_line(job, n, host["ELASTIC_RUN_ROUND"]))
    killed_at = time.time()
    job.kill(victim)
    rows = job.wait_world(4, after=killed_at, timeout=30)
    assert {int(r["RANK"]) for r in rows} == set(range(4))
    assert {r["MASTER_PORT"] for r in rows} != {host["MASTER_PORT"]}
    first = min(r["t"] for r in rows)
    print(f"SIGKILL of the rank-0 node -> first step at world 4: {first - killed_at:.2f} s")

    survivors = [n for n in "abc" if n != victim]
    leaving_at = time.time()
    job.terminate(survivors[0])
    rows = job.wait_world(2, after=leaving_at, timeout=30)
    assert {int(r["RANK"]) for r in rows} == {0, 1}
    first = min(r["t"] for r in rows)
    print(f"SIGTERM -> first step at world 2: {first - leaving_at:.2f} s")
    # Graceful leave revokes the lease: its node key is gone the moment the agent
    # exits (an expiring lease would keep it for up to the TTL).
    assert job.wait_exit(survivors[0], timeout=20) in (0, 128 + signal.SIGTERM)
    assert job.node_keys() == {survivors[1]}
    # Membership changes are not worker failures: the restart count stays 0.
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in job.steps()} == {"0"}


def _plan_line(job, node: str, round_id: str) -> str:
    for line in job.agent_log(node).splitlines():
        if f"round {round_id}:" in line:
            return line.split("[", 2)[-1]
    return ""


def test_below_min_nodes_survivors_wait_then_continue(job):
    """Below --min-nodes the survivor neither trains alone nor gives up: the round it
    joins after the loss stays open (observed in etcd) and closes only with c.

    The machine's temp folder: b's agent, SIGKILLed, cannot remove its scratch folder
    (it holds the etcd password file when there is one); c, started on the same
    machine, removes it, and leaves a's, whose agent lives."""
    job.min_nodes = 2
    job.env["TMPDIR"] = str(job.workdir / "machine-tmp")
    (job.workdir / "machine-tmp").mkdir()
    job.start("a", "b")
    formed = int(job.wait_world(4)[0]["ELASTIC_RUN_ROUND"])
    job.kill("b")
    assert scratch_owners(job) == {job.agents["a"].pid, job.agents["b"].pid}
    waiting = f"rounds/{formed + 1}/"
    job.wait_for(lambda: (job.node_keys() == {"a"} and
                          job.etcd_get(waiting + "join/a") is not None) or None,
                 30, "b's lease to expire and a to join the next round")
    assert job.etcd_get(waiting + "plan") is None       # one joiner < --min-nodes: open
    assert job.agents["a"].poll() is None               # and a still waits
    returned_at = time.time()
    job.start("c")
    rows = job.wait_world(4, after=returned_at, timeout=30)
    assert {int(r["RANK"]) for r in rows} == set(range(4))
    # The round a waited in is the one c closed: a never trained alone.
    assert {r["ELASTIC_RUN_ROUND"] for r in rows} == {str(formed + 1)}
    assert {r["WORLD_SIZE"] for r in job.steps()} == {"4"}
    assert scratch_owners(job) == {job.agents["a"].pid, job.agents["c"].pid}


def scratch_owners(job) -> set[int]:
    """The agents whose scratch folders are in the job's temp folder (agent/scratch.py)."""
    found = (job.workdir / "machine-tmp").glob("elastic-run-agent-*/owner.json")
    return {json.loads(path.read_text())["pid"] for path in found}


def test_five_agents_started_together_agree_on_one_plan(job):
    job.max_nodes = 5
    job.nproc = 1
    job.start(*"abcde")
    rows = job.wait_world(5, timeout=60)
    assert {int(r["RANK"]) for r in rows} == set(range(5))
    # Every agent printed the same plan for that round.
    round_id = rows[0]["ELASTIC_RUN_ROUND"]
    plans = {_plan_line(job, n, round_id) for n in "abcde"}
    assert len(plans) == 1 and plans != {""}
