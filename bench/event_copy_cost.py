"""What one round's events cost etcd when every node copies them, against EventCopy.

Simulated agents (rendezvous_scale.py) publish no events, so that bench never saw
this: each real agent used to copy every event to etcd under a lease of its own, and
`round_closed` carried the plan's whole member list. This replays one in-place round's
events (reform_started, round_closed, resize) of N nodes straight to a fresh etcd,
first as every node used to copy them, then through `EventCopy` (rendezvous/
event_copy.py: the outcome once, by the plan's first member, no member list), and
reports etcd's CPU and the growth of its database for each.

    .venv/bin/python bench/event_copy_cost.py [--nodes 1024] [--threads 8]

Not part of CI. Prints a table and writes bench/latest/event_copy_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path

from elastic_runner.config import EtcdConfig
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.etcd.server import EmbeddedEtcd
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.event_copy import EVENT_TTL_S, EventCopy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import env_info, save  # noqa: E402

PREFIX = "/elastic-runner/v2/cost/"
TICK = os.sysconf("SC_CLK_TCK")


def round_events(nodes: int, node: str) -> list[dict]:
    """One in-place round of `nodes` nodes of 8 workers, as node `node` emits it."""
    members = [{"node": f"node-{i:04d}", "node_rank": i, "first_rank": 8 * i, "nproc": 8}
               for i in range(nodes)]
    common = {"time": time.time(), "run_id": "cost", "node": node, "round": 7}
    return [{**common, "kind": "reform_started", "reason": "member lost: node-9999"},
            {**common, "kind": "round_closed", "world_size": 8 * nodes, "restart_count": 0,
             "master": "10.0.0.1:29500", "cause": "member lost: node-9999",
             "members": members},
            {**common, "kind": "resize", "old_world_size": 8 * nodes + 8,
             "new_world_size": 8 * nodes, "pause_s": 0.4}]


def copy_every_event(client: EtcdClient, node: str, events: list[dict]) -> None:
    """What each agent did before EventCopy: every event, each under a lease of its own."""
    for record in events:
        lease = client.grant_lease(EVENT_TTL_S)
        key = p.event_key(PREFIX, time.time_ns(), node)
        client.put(key, json.dumps(record, default=str).encode(), lease=lease)


def db_size(endpoint: str) -> float:
    """etcd's database size in bytes, from its own /metrics page."""
    text = urllib.request.urlopen(f"{endpoint}/metrics", timeout=10).read().decode()
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("etcd_mvcc_db_total_size_in_bytes "))


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def measure(policy: str, nodes: int, threads: int) -> dict:
    with EmbeddedEtcd() as etcd:
        clients = [EtcdClient(EtcdConfig((etcd.endpoint,), 10.0, 30.0)) for _ in range(threads)]

        def work(k: int) -> None:
            for i in range(k, nodes, threads):
                node = f"node-{i:04d}"
                events = round_events(nodes, node)
                if policy == "every node, every event":
                    copy_every_event(clients[k], node, events)
                else:
                    copy = EventCopy(clients[k], PREFIX, node)
                    for record in events:
                        copy.publish(record)
        time.sleep(1.0)
        size, cpu, started = db_size(etcd.endpoint), cpu_s(etcd.process.pid), time.time()
        workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        wall = time.time() - started
        time.sleep(1.0)  # etcd applies and commits the tail
        result = {"policy": policy, "nodes": nodes, "wall_s": round(wall, 2),
                  "etcd_cpu_s": round(cpu_s(etcd.process.pid) - cpu, 2),
                  "db_growth_mb": round((db_size(etcd.endpoint) - size) / 1e6, 1),
                  "keys": len(clients[0].get_prefix(PREFIX + "events/")[0])}
        for client in clients:
            client.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=8, help="client threads sending")
    args = parser.parse_args()
    if args.nodes < 1 or args.threads < 1:
        parser.error("--nodes and --threads need a whole number of at least 1")
    rows = [measure(policy, args.nodes, args.threads)
            for policy in ("every node, every event", "EventCopy")]
    closed_bytes = len(json.dumps(round_events(args.nodes, "node-0000")[1]))
    lines = [f"event_copy_cost: one in-place round's events of {args.nodes} nodes (round_closed "
             f"with its member list: {closed_bytes:,} bytes), {args.threads} client threads; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores; "
             "etcd CPU includes 1 s of settling",
             f"{'policy':<26}{'etcd CPU':>10}{'db growth':>12}{'keys':>7}{'wall':>8}"]
    lines += [f"{row['policy']:<26}{row['etcd_cpu_s']:>9.2f}s{row['db_growth_mb']:>10.1f}MB"
              f"{row['keys']:>7}{row['wall_s']:>7.2f}s" for row in rows]
    table = "\n".join(lines)
    print(table)
    save("event_copy_cost", {"env": env_info(), "nodes": args.nodes,
                             "round_closed_bytes": closed_bytes, "rows": rows}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
