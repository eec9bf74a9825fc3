"""What etcd spends on N clients that each do what an agent does once at its start.

Issue 17 asks for <= 0.5 s of etcd CPU per round at N = 1,024 nodes; the start
measures 1.3-1.6 s (rendezvous_scale.py). This splits a start into its pieces, each
done by every client at once (threads in --processes forked processes, one etcd
client each, as the simulated agents are), with etcd's CPU read from /proc between
barriers:

  connect + get      a new gRPC channel and one read (the job-spec check's cost floor)
  lease grant        one lease per node
  txn under lease    a guarded create under that lease (the registration's core)
  watch (stream)     a read for the revision, then the client's first watch from it
                     (etcd opens a watch stream for it), as an agent's copy starts;
                     every client watches the same range, as every agent watches the
                     run's round range
  watch (same stream) the same again on that stream: a read and a watch, no stream
  keep-alive stream  the first refresh: the client's long-lived LeaseKeepAlive stream

Then one lease per client is kept alive (TTL 5 s, the agent's default) for 10 s, on
one client per process: the load between rounds, in CPU seconds per second, and the
leases lost.

Each route runs in turn on a fresh etcd: `direct` (each client to etcd) and `proxy`
(each client to one `etcd grpc-proxy` in front of it, elastic_runner/etcd/proxy.py;
the proxy's own CPU is reported beside etcd's).

There is no torchrun side: torch's c10d rendezvous has no etcd; its etcd-v2 backend
is gone with etcd 3.6. The figure to compare with is rendezvous_scale's start.

    .venv/bin/python bench/etcd_start_costs.py            # N = 1,024, both routes, ~60 s
    .venv/bin/python bench/etcd_start_costs.py --clients 256
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common as c  # noqa: E402

from elastic_runner.config import EtcdConfig  # noqa: E402
from elastic_runner.etcd.client import EtcdClient  # noqa: E402
from elastic_runner.etcd.lease import KeptLease  # noqa: E402
from elastic_runner.etcd.proxy import EtcdGrpcProxy  # noqa: E402
from elastic_runner.etcd.server import EmbeddedEtcd  # noqa: E402
from elastic_runner.etcd.values import Put, key_missing  # noqa: E402

PHASES = ("connect + get", "lease grant", "txn under lease", "watch (stream)",
          "watch (same stream)", "keep-alive stream")
PREFIX = "/etcd-start-costs/"
KEEPALIVE_TTL_S = 5  # elastic-run's default --lease-ttl: a refresh every 1.7 s
KEEPALIVE_WINDOW_S = 10.0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Client:
    """One simulated agent's start, a piece at a time."""

    def __init__(self, endpoint: str, name: str):
        self.endpoint, self.name = endpoint, name
        self.etcd: EtcdClient | None = None
        self.lease = 0
        self.watches: list = []

    def phase(self, number: int) -> None:
        if number == 0:
            self.etcd = EtcdClient(EtcdConfig(endpoints=(self.endpoint,), timeout_s=30,
                                              retry_deadline_s=60))
            self.etcd.get(PREFIX + "spec")
        elif number == 1:
            self.lease = self.etcd.grant_lease(300)
        elif number == 2:
            key = f"{PREFIX}nodes/{self.name}"
            self.etcd.txn([key_missing(key)], [Put(key, b"n" * 160, self.lease)])
        elif number in (3, 4):
            revision = self.etcd.get_prefix(f"{PREFIX}round/{number}/")[1]
            self.watches.append(self.etcd.watch_prefix(
                f"{PREFIX}round/{number}/", revision + 1, lambda events: None))
        elif number == 5:
            self.etcd.refresh_lease(self.lease, 30.0)


def process_main(endpoint: str, index: int, count: int, barrier, done, lost) -> None:
    clients = [Client(endpoint, f"p{index}c{i}") for i in range(count)]
    for number in range(len(PHASES)):
        barrier.wait()
        threads = [threading.Thread(target=client.phase, args=(number,)) for client in clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        time.sleep(1.0)  # streams settle; a watch's sync runs on etcd's 100 ms loop
        barrier.wait()
    barrier.wait()  # after the idle window: a lease per client kept alive, as an agent does
    # On one client per process, as rendezvous_scale's agents share one: 1,024 clients
    # each refreshing on its own channel starve 2 cores (909-966 of 1,024 leases lost
    # in 10 s, with the keep-alive code before 2026-12-04's change and after it).
    kept = [KeptLease(clients[0].etcd, KEEPALIVE_TTL_S) for _ in clients]
    barrier.wait()
    done.wait()
    lost.put(sum(lease.lost.is_set() for lease in kept))
    for lease in kept:
        lease.stop()


def measure(endpoint: str, pids: dict[str, int], per: int, processes: int) -> dict:
    """Every piece's CPU for each process in `pids`, their idle rate, then their rate
    while every client keeps a lease alive (the load between rounds)."""
    barrier, done, lost = mp.Barrier(processes + 1), mp.Event(), mp.Queue()
    workers = [mp.Process(target=process_main, args=(endpoint, k, per, barrier, done, lost))
               for k in range(processes)]
    for worker in workers:
        worker.start()
    spent = {}
    for name in PHASES:
        barrier.wait()
        before = {who: cpu_seconds(pid) for who, pid in pids.items()}
        barrier.wait()
        spent[name] = {who: cpu_seconds(pid) - before[who] for who, pid in pids.items()}
    before = {who: cpu_seconds(pid) for who, pid in pids.items()}
    time.sleep(3.0)
    idle = {who: (cpu_seconds(pid) - before[who]) / 3.0 for who, pid in pids.items()}
    barrier.wait()
    barrier.wait()
    time.sleep(2.0)  # every client's keep-alive stream is open
    before = {who: cpu_seconds(pid) for who, pid in pids.items()}
    time.sleep(KEEPALIVE_WINDOW_S)
    kept = {who: (cpu_seconds(pid) - before[who]) / KEEPALIVE_WINDOW_S
            for who, pid in pids.items()}
    done.set()
    leases_lost = sum(lost.get(timeout=60) for _ in workers)
    for worker in workers:
        worker.join(60)
    return {"pieces": spent, "idle_cpu_s_per_s": idle, "keepalive_cpu_s_per_s": kept,
            "leases_lost": leases_lost}


def run_route(route: str, per: int, processes: int) -> dict:
    with EmbeddedEtcd() as etcd:
        if route == "direct":
            return measure(etcd.endpoint, {"etcd": etcd.process.pid}, per, processes)
        with EtcdGrpcProxy(etcd.endpoint) as proxy:
            return measure(proxy.endpoint, {"etcd": etcd.process.pid,
                                            "proxy": proxy.process.pid}, per, processes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1024)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--routes", default="direct,proxy")
    args = parser.parse_args()
    per = max(1, args.clients // args.processes)
    n = per * args.processes
    routes = args.routes.split(",")
    results = {route: run_route(route, per, args.processes) for route in routes}
    header, rows = ["piece of a start"], []
    for route in routes:
        header += [f"etcd CPU, {route}", "ms per client"]
        header += ["proxy CPU", "ms per client"] if route == "proxy" else []
    for name in PHASES:
        row = [name]
        for route in routes:
            for who, used in results[route]["pieces"][name].items():
                row += [f"{used:.2f} s", f"{1000 * used / n:.3f}"]
        rows.append(row)
    total = ["all pieces"]
    for route in routes:
        for who in results[route]["idle_cpu_s_per_s"]:
            used = sum(piece[who] for piece in results[route]["pieces"].values())
            total += [f"{used:.2f} s", f"{1000 * used / n:.3f}"]
    env = c.env_info()
    idle = ", ".join(f"{who} ({route}) {rate:.3f}" for route in routes
                     for who, rate in results[route]["idle_cpu_s_per_s"].items())
    kept = "; ".join(
        ", ".join(f"{who} ({route}) {rate:.3f} s/s" for who, rate in
                  results[route]["keepalive_cpu_s_per_s"].items())
        + f", {results[route]['leases_lost']} lost" for route in routes)
    text = (f"etcd_start_costs: {n} etcd clients in {args.processes} processes, each piece "
            f"done by all at once; CPU includes 1 s of settling per piece (idle s/s: {idle})"
            f"\n{env['date_utc']} UTC, {env['cores']} cores, etcd {env['etcd']}\n"
            + c.table(header, rows + [total])
            + f"\nthen {n} leases kept alive (TTL {KEEPALIVE_TTL_S} s, one client per process) "
            f"for {KEEPALIVE_WINDOW_S:.0f} s: {kept}")
    print(text)
    saved = c.save("etcd_start_costs", {"args": vars(args), "env": env, "clients": n,
                                        "routes": results}, text)
    print(f"\nwritten: {saved}")


if __name__ == "__main__":
    main()
