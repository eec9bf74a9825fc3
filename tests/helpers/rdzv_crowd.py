"""A crowd of rendezvous agents in one process, for tests that need hundreds of them.

Why a separate process: a test that starves agents of CPU (SIGSTOP) has to stop
whole processes, and hundreds of agents as threads of the test itself would
starve pytest too. Why threads sharing one EtcdClient: as in bench/rdzv_agents.py,
a gRPC channel per agent costs poller threads that starved the keep-alives on a
small machine; each agent still has its own lease, watch and copy of etcd.

What the parent learns comes from files, not pipes: every plan an agent gets is
one JSON line in OUT/<index>.jsonl, written and flushed whole, so a reader that
polls the file (and skips a line cut by a kill) needs nothing from a process that
may be stopped. SIGUSR1 writes every thread's stack to OUT/<index>.stacks, so a
test that times out can say where the agents were; OUT/<index>.jsonl exists only
once that handler does (before it, SIGUSR1 would kill the process).

    python -m tests.helpers.rdzv_crowd --endpoint E --run-id R --index P \
        --first I --count K --max-nodes N --lease-ttl T --out DIR
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import logging
import os
import signal
import threading
import time
import traceback
from pathlib import Path

from elastic_runner.config import EtcdConfig, RendezvousConfig
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.engine import EtcdRendezvous
from tests.helpers.rdzv_nodes import follow_rounds

SETTLE_S = 1.0
# Starved agents wait long for a round; the test's own deadline ends a stuck run.
JOIN_TIMEOUT_S = 300.0
# Calls are slow with 64 agents per process on two shared cores.
CALL_TIMEOUT_S = 30.0
# How long a SIGTERM'd crowd tries to revoke its leases before it exits anyway.
LEAVE_S = 5.0


def node_name(number: int) -> str:
    return f"c{number:04d}"


def digest(node_ids) -> str:
    """Short and order-sensitive: two agents agree only on the same ranks."""
    return hashlib.sha1("\n".join(node_ids).encode()).hexdigest()[:12]


def where(exc: BaseException) -> list[str]:
    """The project's frames that raised (not gRPC's or tenacity's), short enough to
    quote in a test's failure."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "elastic_runner" in f.filename or "rdzv_crowd" in f.filename][-10:]
    return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames]


class Report:
    """One JSON line per event, whole and flushed, from any thread."""

    def __init__(self, path: Path):
        self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        line = json.dumps({**record, "t": round(time.time(), 3)}, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()


class Agent:
    """One agent of the crowd: rdzv_nodes.follow_rounds, each plan reported."""

    def __init__(self, client: EtcdClient, args, node_id: str, report: Report):
        config = RendezvousConfig(args.run_id, node_id, min_nodes=1, max_nodes=args.max_nodes,
                                  lease_ttl_s=args.lease_ttl, settle_s=SETTLE_S,
                                  join_timeout_s=JOIN_TIMEOUT_S)
        self.node_id = node_id
        self.rdzv = EtcdRendezvous(client, config, p.JobSpec(1, args.max_nodes, "crowd"), 0)
        self.stopping = threading.Event()
        self._report = report
        self.thread = threading.Thread(target=self._run, name=f"agent {node_id}", daemon=True)

    def _run(self) -> None:
        try:
            self.rdzv.register()
            follow_rounds(self.rdzv, self._got, self.stopping)
        except BaseException as exc:  # noqa: BLE001 - the test reads and reports it
            if not self.stopping.is_set():
                self._report.write({"node": self.node_id,
                                    "error": f"{type(exc).__name__}: {exc}",
                                    "where": where(exc)})

    def _got(self, plan: p.Plan) -> p.Plan:
        self._report.write({"node": self.node_id, "round": plan.round,
                            "members": len(plan.members), "digest": digest(plan.node_ids),
                            "lease": self.rdzv.lease.id})
        return plan

    def stop(self) -> None:
        self.stopping.set()
        self.rdzv.interrupt()

    def leave(self) -> None:
        """Leave as an agent does on SIGTERM: revoke the lease so nobody waits its TTL."""
        try:
            self.rdzv.leave()
        except Exception:  # noqa: BLE001 - etcd may be gone already; the TTL ends it
            pass


def stop_all(agents: list[Agent]) -> None:
    """Stop every agent first, then leave side by side, for at most LEAVE_S.

    One after another, 64 leaves behind one busy channel kept a child alive for
    over 20 s after SIGTERM; a lease not revoked in time still expires on its own.
    """
    for agent in agents:
        agent.stop()
    leaving = [threading.Thread(target=agent.leave, daemon=True) for agent in agents]
    for thread in leaving:
        thread.start()
    deadline = time.monotonic() + LEAVE_S
    for thread in leaving:
        thread.join(max(0.0, deadline - time.monotonic()))


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--index", type=int, required=True, help="names OUT/<index>.jsonl")
    parser.add_argument("--first", type=int, required=True, help="number of the first node id")
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--max-nodes", type=int, required=True)
    parser.add_argument("--lease-ttl", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def wait_for_stop(stop: threading.Event) -> None:
    """Until SIGTERM, or until the parent is gone (a killed test leaves no crowd behind)."""
    parent = os.getppid()
    while not stop.wait(1.0):
        if os.getppid() != parent:
            return


def main(argv=None) -> None:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(threadName)s %(name)s: %(message)s")
    stacks = open(args.out / f"{args.index}.stacks", "w", encoding="utf-8")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    report = Report(args.out / f"{args.index}.jsonl")
    client = EtcdClient(EtcdConfig.build((args.endpoint,), timeout_s=CALL_TIMEOUT_S))
    agents = [Agent(client, args, node_name(args.first + i), report) for i in range(args.count)]
    for agent in agents:
        agent.thread.start()
    wait_for_stop(stop)
    stop_all(agents)
    # Daemon threads blocked in gRPC calls would hold an orderly interpreter exit.
    os._exit(0)


if __name__ == "__main__":
    main()
