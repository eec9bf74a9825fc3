"""A paper estimate of one leave or join round at 4,096 and 16,384 nodes, from the
costs rendezvous_scale.py measured (latest/rendezvous_scale.json), for a 3-member
etcd cluster.

Why on paper: this machine has 2 cores; 4,096 simulated agents would measure the
simulation, not the rendezvous. What scales is known per event: each agent sends one
join transaction per round (a write every member applies), a non-deputy agent gets
two watch events (the round key opens; it closes carrying the change to the previous
plan, carried_plan.py, a few hundred bytes whatever N), each of the deputies gets two
events per agent (its join, and the delete of its previous join in the same write) and
reads the whole plan, which grows by a few bytes per member.
etcd's CPU per write is measured here (1,024 join-like transactions on an embedded
etcd); its CPU per agent beyond that write (the agent's two events, its watch) is what
the measured rounds at the largest N spent beyond their writes, divided by N.

    .venv/bin/python bench/rendezvous_estimate.py [--json bench/latest/rendezvous_scale.json]

The last line checks the estimate's own N=1,024 row against a real 3-member cluster
where latest/rendezvous_scale-3members.json exists (rendezvous_scale.py --etcd-members 3).

Assumptions, printed with the table: every member of the cluster applies every write
(raft), requests and watch streams are spread evenly over the 3 members, 3 deputies,
node ids of ~8 bytes; "distinct addresses" gives every node its own IPv4 address (the
extra bytes measured on a 1,024-member plan); the agents' own CPU per round is the
measured round work (idle ticks taken out) plus rebuilding the larger plan from the
round key's edit (timed here).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c  # noqa: E402

DEPUTIES = 3
MEMBERS = 3
SIZES = (4096, 16384)


def write_cost_s(count: int = 1024) -> float:
    """etcd CPU per join-like write (a transaction putting one key under a lease,
    compared against a round key), measured here on an embedded etcd."""
    import threading

    from elastic_runner.etcd.client import Put, mod_revision_is
    from elastic_runner.etcd.server import EmbeddedEtcd
    from rdzv_agents import cpu_seconds, new_client

    with EmbeddedEtcd(extra_args=("--heartbeat-interval", "10",
                                  "--election-timeout", "100")) as server:
        clients = [new_client(server.endpoint) for _ in range(8)]
        lease = clients[0].grant_lease(120)
        clients[0].put("/estimate/round", b"r")
        guard = mod_revision_is("/estimate/round", clients[0].get("/estimate/round").mod_revision)

        def joins(client, ids) -> None:
            for i in ids:
                client.txn([guard], [Put(f"/estimate/join/{i:06d}", b"j" * 80, lease)])
        before = cpu_seconds([server.process.pid])
        threads = [threading.Thread(target=joins, args=(cl, range(k, count, 8)))
                   for k, cl in enumerate(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        spent = cpu_seconds([server.process.pid]) - before
        for client in clients:
            client.close()
    return spent / count


def per_agent_cost_s(res: dict, write_s: float) -> float:
    """etcd CPU per agent per round beyond its join write: the measured leave/join
    rounds' CPU less their writes, over N. Why per agent, not per byte: since the
    round key carries the change, not the plan, what each agent receives is a
    constant few hundred bytes, so the rest is per watcher and per event."""
    costs = [(res[f"{p}_etcd_cpu_s"] - write_s * res[f"{p}_requests"].get("Txn", 0)) / res["n"]
             for p in ("leave", "join")]
    return max(sum(costs) / len(costs), 0.0)


def plan_costs(n: int = 1024) -> tuple[float, float]:
    """(bytes a distinct address per node adds per member, ms for a member to rebuild a
    plan of n members from the round key's edit of a leave), measured here."""
    import timeit

    from elastic_runner.rendezvous import carried_plan
    from elastic_runner.rendezvous import protocol as p
    from elastic_runner.rendezvous.ranks import build_plan

    def plan(addr, number=0, skip=-1) -> p.Plan:
        joiners = [p.Joiner(f"s{i:04d}", addr(i), 29500, 1, i) for i in range(n) if i != skip]
        return build_plan(number, joiners, n, 0, "start")
    same = plan(lambda i: "127.0.0.1").to_json()
    distinct = plan(lambda i: f"10.{i // 65536}.{i // 256 % 256}.{i % 256}").to_json()
    before = p.Plan.from_json(same)
    after = plan(lambda i: "127.0.0.1", 1, n // 2)
    raw = carried_plan.round_value(p.RoundState(1, p.CLOSED), after, before)
    rebuild_s = min(timeit.repeat(lambda: carried_plan.carried(raw, {0: before}).member("s0001"),
                                  number=10, repeat=3)) / 10
    return (len(distinct) - len(same)) / n, rebuild_s * 1e3


def estimate(n: int, write_s: float, agent_s: float, bytes_per_member: float,
             work_ms: float, distinct_bytes: float, rebuild_ms: float,
             key_bytes: float) -> list[str]:
    requests = n + 1  # the joins, and the newcomer's registration
    events = 2 * (n - DEPUTIES) + DEPUTIES * (2 * n + 1)  # joins + the old joins' deletes
    plans = [bytes_per_member * n, (bytes_per_member + distinct_bytes) * n]
    # Every member applies every write; watch streams are spread over the members.
    cpu = write_s * requests + agent_s * n / MEMBERS
    fanned = [n * key_bytes + DEPUTIES * plan for plan in plans]
    return [f"N={n:,}", f"{requests:,}", f"{events:,}",
            " / ".join(f"{plan / 1e3:,.0f}" for plan in plans) + " KB",
            " / ".join(f"{b / 1e6:,.1f}" for b in fanned) + " MB",
            f"{cpu:,.2f} s",
            f"{work_ms + rebuild_ms * (n / 1024 - 1):.1f} ms"]


def cluster_check(path: Path, predicted: str) -> str:
    """The estimate's own N row against a measured 3-member cluster, where one was run
    (rendezvous_scale.py --etcd-members 3): the check on its per-member assumption."""
    if not path.is_file():
        return f"\n(no {path.name}: the per-member split is not checked against a cluster)"
    data = json.loads(path.read_text())
    largest = data["elastic_run"][max(data["elastic_run"], key=int)]
    busiest = ", ".join(
        f"{phase} {max(largest[f'{phase}_etcd_cpu_s_by_member']):.2f} s"
        for phase in ("leave", "join") if largest.get(f"{phase}_etcd_cpu_s_by_member"))
    return (f"\ncheck: a real {MEMBERS}-member cluster at N={largest['n']:,} ({path.name}, "
            f"{data['env']['date_utc']} UTC): busiest member {busiest}; the estimate's "
            f"N={largest['n']:,} row: {predicted} per member")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=str(Path(__file__).parent / "latest" /
                                                "rendezvous_scale.json"))
    args = parser.parse_args()
    data = json.loads(Path(args.json).read_text())
    largest = data["elastic_run"][max(data["elastic_run"], key=int)]
    n = largest["n"]
    write_s = write_cost_s()
    agent_s = per_agent_cost_s(largest, write_s)
    bytes_per_member = largest["plan_bytes"] / n
    key_bytes = max(largest.get(f"{p}_round_key_bytes") or 0 for p in ("leave", "join"))
    idle = largest.get("idle_agent_cpu_ms_per_agent_s", 0.0)
    work_ms = min(largest[f"{p}_agent_cpu_ms_per_agent"] - idle * largest[f"{p}_s"]
                  for p in ("leave", "join"))
    distinct_bytes, rebuild_ms = plan_costs()
    rows = [estimate(size, write_s, agent_s, bytes_per_member, work_ms, distinct_bytes,
                     rebuild_ms, key_bytes) for size in (n, *SIZES)]
    print(f"measured: {write_s * 1e3:.3f} ms of etcd CPU per join write (here, 1,024 "
          f"writes); {agent_s * 1e3:.3f} ms per agent beyond its write (the N={n} leave "
          f"and join rounds' etcd CPU less their writes, over N); round key {key_bytes:.0f} "
          f"bytes to every agent; plan {bytes_per_member:.1f} bytes per member (+"
          f"{distinct_bytes:.1f} with a distinct address per node), read whole by the "
          f"{DEPUTIES} deputies; agent round work {work_ms:.1f} ms (CPU per agent less "
          f"idle), +{rebuild_ms:.2f} ms per 1,024 more members to rebuild the plan\n")
    print(c.table(["one leave or join round", "etcd requests", "watch events",
                   "plan (same / distinct addrs)", "bytes fanned out (same / distinct)",
                   "etcd CPU per member", "agent CPU per agent"], rows))
    print(cluster_check(Path(args.json).with_name("rendezvous_scale-3members.json"),
                        rows[0][5]))


if __name__ == "__main__":
    main()
