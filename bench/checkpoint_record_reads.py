"""What a start's checkpoint-record reads cost etcd and each worker, two ways.

Every rank reads the record of the newest verified checkpoint when it loads. Issue 17
asks for <= 0.5 s of etcd CPU per round at 1,024 nodes; this measures that read for
N nodes x W workers, all at once (threads in --processes forked processes):

  own connection   each worker opens its own etcd client, reads, closes (before
                   2026-12-07: EtcdLatestStore in every rank)
  through agent    each node's agent, already connected, answers its W workers on a
                   Unix socket; one read serves every worker that asked before it
                   began, and waits up to 50 ms for the node's W (record_relay.py)

etcd's CPU is read from /proc around each; the bench processes' CPU (the simulated
workers and agents) beside it. Then one worker's own cost in a fresh interpreter that
has imported torch, as a real worker has: reading the record each way (the first way
imports the etcd client), --repeats times.

There is no torchrun side: torchrun keeps no shared checkpoint record (a torchrun
script finds its newest checkpoint by listing storage itself).

    .venv/bin/python bench/checkpoint_record_reads.py                # 1,024 x 8, ~1 min
    .venv/bin/python bench/checkpoint_record_reads.py --nodes 64 --workers 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common as c  # noqa: E402
from etcd_start_costs import cpu_seconds  # noqa: E402

from elastic_runner.config import EtcdConfig  # noqa: E402
from elastic_runner.etcd.client import EtcdClient  # noqa: E402
from elastic_runner.etcd.server import EmbeddedEtcd  # noqa: E402
from elastic_runner.record_relay import RecordRelay, ask_record, read_json  # noqa: E402
from elastic_runner.rendezvous.protocol import checkpoint_key  # noqa: E402
from elastic_runner.worker.checkpoint.etcd_store import EtcdLatestStore  # noqa: E402

PREFIX = "/elastic-runner/v2/checkpoint-record-reads/"
RECORD = {"url": "file:///ckpt/step-00000500", "step": 500, "sha256": "ab" * 32,
          "world_size": 8192}
ROUTES = ("own connection", "through agent")
WAVE = 128  # workers per process at once on the own-connection route (file descriptors)


def config(endpoint: str) -> EtcdConfig:
    return EtcdConfig(endpoints=(endpoint,), timeout_s=30, retry_deadline_s=60)


def own_connection(endpoint: str, workers: int) -> int:
    def one() -> None:
        store = EtcdLatestStore((endpoint,), PREFIX, 0, {"timeout_s": 30})
        assert store.read() == RECORD
        store.close()
    for start in range(0, workers, WAVE):
        threads = [threading.Thread(target=one) for _ in range(min(WAVE, workers - start))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return workers


class CountedRead:
    def __init__(self, client: EtcdClient):
        self.reads, self._read = 0, read_json(client, checkpoint_key(PREFIX))

    def __call__(self) -> dict | None:
        self.reads += 1
        return self._read()


def through_agents(endpoint: str, nodes: int, workers: int, ready, go) -> int:
    """`nodes` agents, each connected before the measurement; `workers` askers each."""
    folder = Path(tempfile.mkdtemp(prefix="record-reads-"))
    agents = []
    for index in range(nodes):
        client = EtcdClient(config(endpoint))
        client.get(PREFIX + "spec")  # connected, as an agent is long before its workers load
        counted = CountedRead(client)
        (folder / str(index)).mkdir()
        agents.append((client, counted, RecordRelay.start(folder / str(index), counted,
                                                          workers)))
    ready.wait()
    go.wait()
    threads = [threading.Thread(target=lambda path=str(relay.path):
                                ask_record(path) == RECORD or sys.exit("wrong record"))
               for _, _, relay in agents for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for client, _, relay in agents:
        relay.close()
        client.close()
    return sum(counted.reads for _, counted, _ in agents)


def process_main(route: str, endpoint: str, nodes: int, workers: int, ready, go, out) -> None:
    if route == ROUTES[0]:
        ready.wait()
        go.wait()
        out.put(own_connection(endpoint, nodes * workers))
    else:
        out.put(through_agents(endpoint, nodes, workers, ready, go))


def measure(route: str, endpoint: str, etcd_pid: int, nodes: int, workers: int,
            processes: int) -> dict:
    # Spawned, not forked: this process holds a gRPC channel, and gRPC does not survive
    # a fork (the children's calls hang).
    spawn = mp.get_context("spawn")
    ready, go, out = spawn.Barrier(processes + 1), spawn.Barrier(processes + 1), spawn.Queue()
    per = nodes // processes
    children = [spawn.Process(target=process_main,
                           args=(route, endpoint, per, workers, ready, go, out))
                for _ in range(processes)]
    for child in children:
        child.start()
    ready.wait()
    etcd_before = cpu_seconds(etcd_pid)
    bench_before = sum(cpu_seconds(child.pid) for child in children)
    started = time.perf_counter()
    go.wait()
    reads = sum(out.get(timeout=600) for _ in children)
    wall = time.perf_counter() - started
    etcd_used = cpu_seconds(etcd_pid) - etcd_before
    bench_used = sum(cpu_seconds(child.pid) for child in children) - bench_before
    for child in children:
        child.join(60)
    return {"etcd_cpu_s": round(etcd_used, 3), "bench_cpu_s": round(bench_used, 3),
            "wall_s": round(wall, 3), "etcd_reads": reads}


WORKER_SIDE = """
import sys, time, json
sys.path.insert(0, {root!r})
import torch
started = time.process_time()
{body}
print(json.dumps(time.process_time() - started))
"""
BODIES = {
    ROUTES[0]: "from elastic_runner.worker.checkpoint.etcd_store import EtcdLatestStore\n"
               "EtcdLatestStore(({endpoint!r},), {prefix!r}, 0).read()",
    ROUTES[1]: "from elastic_runner.record_relay import ask_record\nask_record({socket!r})",
}


def worker_side(endpoint: str, socket_path: str, repeats: int) -> dict:
    """A fresh interpreter per try: the import is part of what a worker pays."""
    costs = {}
    for route, body in BODIES.items():
        code = WORKER_SIDE.format(root=str(c.ROOT), body=body.format(
            endpoint=endpoint, prefix=PREFIX, socket=socket_path))
        costs[route] = [json.loads(subprocess.run([c.PY, "-c", code], check=True,
                                                  capture_output=True, text=True).stdout)
                        for _ in range(repeats)]
    return costs


def run(args) -> dict:
    with EmbeddedEtcd() as etcd:
        setup = EtcdClient(config(etcd.endpoint))
        setup.put(checkpoint_key(PREFIX), json.dumps(RECORD).encode())
        results = {route: measure(route, etcd.endpoint, etcd.process.pid, args.nodes,
                                  args.workers, args.processes) for route in ROUTES}
        with tempfile.TemporaryDirectory() as folder:
            relay = RecordRelay.start(Path(folder), read_json(setup, checkpoint_key(PREFIX)))
            try:
                per_worker = worker_side(etcd.endpoint, str(relay.path), args.repeats)
            finally:
                relay.close()
        setup.close()
    return {"routes": results, "worker_cpu_s": per_worker}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=8, help="per node")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    args.nodes -= args.nodes % args.processes
    result = run(args)
    own, relayed = (result["routes"][route] for route in ROUTES)
    rows = []
    for route in ROUTES:
        got, worker = result["routes"][route], result["worker_cpu_s"][route]
        rows.append([route, got["etcd_reads"], f"{got['etcd_cpu_s']:.2f} s",
                     f"{got['bench_cpu_s']:.2f} s", f"{got['wall_s']:.2f} s",
                     f"{1000 * statistics.median(worker):.0f} ms "
                     f"[{1000 * min(worker):.0f}-{1000 * max(worker):.0f}]"])
    ratio = own["etcd_cpu_s"] / relayed["etcd_cpu_s"] if relayed["etcd_cpu_s"] else None
    env = c.env_info()
    text = (f"checkpoint_record_reads: {args.nodes} nodes x {args.workers} workers read "
            f"the checkpoint record at once ({args.processes} processes)\n"
            f"{env['date_utc']} UTC, {env['cores']} cores, etcd {env['etcd']}\n"
            + c.table(["route", "etcd reads", "etcd CPU", "bench CPU (workers + agents)",
                       "wall", f"one worker's CPU, fresh after torch (x{args.repeats})"],
                      rows)
            + "\netcd CPU, own connection / through agent: "
            + (f"{ratio:.1f}x" if ratio else "n/a (no measurable CPU through the agent)"))
    print(text)
    saved = c.save("checkpoint_record_reads", {"args": vars(args), "env": env, **result}, text)
    print(f"\nwritten: {saved}")


if __name__ == "__main__":
    main()
