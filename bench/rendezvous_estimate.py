"""A paper estimate of one leave or join round at 4,096 and 16,384 nodes, from the
costs rendezvous_scale.py measured (latest/rendezvous_scale.json), for a 3-member
etcd cluster.

Why on paper: this machine has 2 cores; 4,096 simulated agents would measure the
simulation, not the rendezvous. What scales is known per event: each agent sends one
join transaction per round (a write every member applies), a non-deputy agent gets
two watch events (the round key opens; it closes carrying the plan), each of the
deputies gets one event per join, and the plan grows by a few bytes per member.
etcd's CPU per write is measured here (1,024 join-like transactions on an embedded
etcd), its CPU per byte of plan fanned out to the watchers is what the measured rounds
at the largest N spent beyond their writes, and the plan's bytes per member come from
that N's plan.

    .venv/bin/python bench/rendezvous_estimate.py [--json bench/latest/rendezvous_scale.json]

Assumptions, printed with the table: every member of the cluster applies every write
(raft), requests and watch streams are spread evenly over the 3 members, 3 deputies,
node ids of ~8 bytes; "distinct addresses" gives every node its own IPv4 address (the
extra bytes measured on a 1,024-member plan); the agents' own CPU per round is the
measured round work (idle ticks taken out) plus parsing the larger plan (timed here).
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


def fanout_cost_s_per_byte(res: dict, write_s: float) -> float:
    """etcd CPU per byte of plan sent to watchers: the measured leave/join rounds' CPU
    less their writes, over the plan bytes fanned out (N x the plan). Why bytes: from
    N=256 to 1,024 the rounds' etcd CPU grew x14 for N x4, as N x plan does (x15), so
    the plan each agent receives, not the count of events, is what grows."""
    costs = [(res[f"{p}_etcd_cpu_s"] - write_s * res[f"{p}_requests"].get("Txn", 0))
             / (res["n"] * res[f"{p}_plan_bytes"]) for p in ("leave", "join")]
    return max(sum(costs) / len(costs), 0.0)


def plan_costs(n: int = 1024) -> tuple[float, float]:
    """(bytes a distinct address per node adds per member, ms to parse n members),
    measured on a plan of n members like the benchmark's."""
    import timeit

    from elastic_runner.rendezvous import protocol as p
    from elastic_runner.rendezvous.ranks import build_plan

    def plan(addr) -> p.Plan:
        joiners = [p.Joiner(f"s{i:04d}", addr(i), 29500, 1, i) for i in range(n)]
        return build_plan(0, joiners, n, 0, "start")
    same = plan(lambda i: "127.0.0.1").to_json()
    distinct = plan(lambda i: f"10.{i // 65536}.{i // 256 % 256}.{i % 256}").to_json()
    parse_s = min(timeit.repeat(lambda: p.Plan.from_json(same), number=10, repeat=3)) / 10
    return (len(distinct) - len(same)) / n, parse_s * 1e3


def estimate(n: int, write_s: float, byte_s: float, bytes_per_member: float,
             work_ms: float, distinct_bytes: float, parse_ms: float) -> list[str]:
    requests = n + 1  # the joins, and the newcomer's registration
    events = 2 * (n - DEPUTIES) + DEPUTIES * (n + 1)
    plans = [bytes_per_member * n, (bytes_per_member + distinct_bytes) * n]
    # Every member applies every write; watch streams are spread over the members.
    cpu = [write_s * requests + byte_s * n * plan / MEMBERS for plan in plans]
    return [f"N={n:,}", f"{requests:,}", f"{events:,}",
            " / ".join(f"{plan / 1e3:,.0f}" for plan in plans) + " KB",
            " / ".join(f"{n * plan / 1e6:,.0f}" for plan in plans) + " MB",
            " / ".join(f"{seconds:,.2f}" for seconds in cpu) + " s",
            f"{work_ms + parse_ms * (n / 1024 - 1):.1f} ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=str(Path(__file__).parent / "latest" /
                                                "rendezvous_scale.json"))
    args = parser.parse_args()
    data = json.loads(Path(args.json).read_text())
    largest = data["elastic_run"][max(data["elastic_run"], key=int)]
    n = largest["n"]
    write_s = write_cost_s()
    byte_s = fanout_cost_s_per_byte(largest, write_s)
    bytes_per_member = largest["plan_bytes"] / n
    idle = largest.get("idle_agent_cpu_ms_per_agent_s", 0.0)
    work_ms = min(largest[f"{p}_agent_cpu_ms_per_agent"] - idle * largest[f"{p}_s"]
                  for p in ("leave", "join"))
    distinct_bytes, parse_ms = plan_costs()
    rows = [estimate(size, write_s, byte_s, bytes_per_member, work_ms, distinct_bytes, parse_ms)
            for size in (n, *SIZES)]
    print(f"measured: {write_s * 1e3:.3f} ms of etcd CPU per join write (here, 1,024 "
          f"writes); {byte_s * 1e9:.1f} ms per MB of plan fanned out to watchers (the N={n} "
          f"leave and join rounds' etcd CPU less their writes); plan {bytes_per_member:.1f} "
          f"bytes per member (+{distinct_bytes:.1f} with a distinct address per node); agent "
          f"round work {work_ms:.1f} ms (CPU per agent less idle), +{parse_ms:.2f} ms per "
          f"1,024 more members to parse\n")
    print(c.table(["one leave or join round", "etcd requests", "watch events",
                   "plan (same / distinct addrs)", "plan bytes fanned out",
                   "etcd CPU per member (same / distinct)", "agent CPU per agent"], rows))


if __name__ == "__main__":
    main()
