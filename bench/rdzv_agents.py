"""The simulated agents of rendezvous_scale.py and what measures them.

An agent here is the real EtcdRendezvous (its lease, watch and mirror) running the
agent's loop without workers: register, unless the run re-forms in place (asked in
the same request, as a real agent does, agent/standby.py), next_plan, then
change_reason on every watch event or every 0.1 s. Spread over processes, each process's agents share
one gRPC channel; CPU time is read from /proc, and etcd's own request and
watch-event counters from its /metrics page: counted where they are served, they
cover threads and processes alike and need no hook in the engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
import urllib.request
from pathlib import Path

from etcd_profile import WindowProfiler


# etcd 3.4/3.5 count each event as its watch stream sends it to the watcher (v3rpc
# watch.go: mvcc.ReportEventReceived before gRPCStream.Send), once per watcher: one put
# seen by 2 watchers adds 2, and a watcher's catch-up from a past revision adds its
# events too. It grows as N x N when every agent watches what every agent writes,
# which the request counts do not show.
WATCH_EVENTS = "etcd_debugging_mvcc_events_total"


def scrape(endpoints) -> tuple[dict[str, float], float | None]:
    """(requests by gRPC method, watch events sent), summed over the members' /metrics
    pages (each counts what it served itself), read back to back so both are taken at
    about the same instant; events None where this etcd lacks the counter."""
    requests: dict[str, float] = {}
    events = None
    for endpoint in endpoints:
        text = urllib.request.urlopen(f"{endpoint}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith("grpc_server_msg_received_total{"):
                method = re.search(r'grpc_method="([^"]+)"', line).group(1)
                requests[method] = requests.get(method, 0) + float(line.rsplit(" ", 1)[1])
            elif line.startswith(WATCH_EVENTS + " "):
                events = (events or 0.0) + float(line.rsplit(" ", 1)[1])
    return requests, events


def delta(a: dict, b: dict) -> dict:
    d = {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b)}
    return {k: int(v) for k, v in sorted(d.items()) if v}


class SimAgent:
    def __init__(self, endpoint: str, run_id: str, node: str, max_nodes: int, settle: float,
                 ttl: int, client=None):
        from elastic_runner.config import RendezvousConfig
        from elastic_runner.rendezvous.engine import EtcdRendezvous
        from elastic_runner.rendezvous.protocol import JobSpec
        self.owns_client = client is None
        self.client = client or new_client(endpoint)
        cfg = RendezvousConfig(run_id=run_id, node_id=node, min_nodes=1, max_nodes=max_nodes,
                               lease_ttl_s=ttl, settle_s=settle, join_timeout_s=300)
        self.rdzv = EtcdRendezvous(self.client, cfg, JobSpec(1, max_nodes, "bench"), 3)
        self.plans: list[tuple[float, int, tuple]] = []
        self.on_plan = None  # set in --processes mode: reports each plan to the parent
        self.stop = threading.Event()
        self.error: str | None = None

    def run(self, go: float, monitor: bool) -> None:
        from elastic_runner.rendezvous.protocol import Cause, CauseKind
        try:
            time.sleep(max(0.0, go - time.time()))
            if not self.rdzv.register(unless_in_place=True):  # as agent/standby.py registers
                self.rdzv.register()  # (a run marked in place: no standby workers here)
            plan = self.rdzv.next_plan(None, Cause(CauseKind.START))
            self._record(plan)
            while monitor and not self.stop.is_set():
                gen = self.rdzv.change_marker()
                reason = self.rdzv.change_reason(plan)
                if reason is not None:
                    plan = self.rdzv.next_plan(plan, reason)
                    self._record(plan)
                else:
                    self.rdzv.wait_for_change(0.1, gen)
        except Exception as exc:  # noqa: BLE001
            if not self.stop.is_set():
                self.error = f"{type(exc).__name__}: {exc}"

    def _record(self, plan) -> None:
        self.plans.append((time.time(), plan.round, plan.node_ids))
        if self.on_plan is not None:
            self.on_plan(self.plans[-1])

    def close(self, leave: bool) -> None:
        self.stop.set()
        self.rdzv.shutdown.set()
        try:
            if leave:
                self.rdzv.leave()
            else:
                if self.rdzv.lease:
                    self.rdzv.lease.stop()
                self.rdzv.mirror.stop()
        except Exception:  # noqa: BLE001
            pass
        self.rdzv.mirror.wake()


def new_client(endpoint: str):
    from elastic_runner.config import EtcdConfig
    from elastic_runner.etcd.client import EtcdClient
    # Hundreds of simulated agents share one process: calls are slow under that load.
    return EtcdClient(EtcdConfig.build((endpoint,), timeout_s=30.0))


def agreed(agents, size: int, after_round: int):
    """(time, round) once every agent's newest plan is the same round > after_round with
    `size` members; else None."""
    last = [a.plans[-1] if a.plans else None for a in agents]
    if any(p is None or p[1] <= after_round for p in last):
        return None
    rounds = {p[1] for p in last}
    members = {p[2] for p in last}
    if len(rounds) == 1 and len(members) == 1 and len(next(iter(members))) == size:
        return max(p[0] for p in last), rounds.pop()
    return None


def wait_agreed(agents, size, after_round, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = agreed(agents, size, after_round)
        if got:
            return got
        errors = [a.error for a in agents if a.error]
        if errors:
            return None
        time.sleep(0.02)
    return None


def _group_main(endpoints, first_member, run_id, names, max_nodes, settle, ttl, go, monitor,
                updates, commands) -> None:
    """One child process: its share of the simulated agents, as threads."""
    agents = {}
    # One gRPC channel per process and etcd member, shared by its agents (HTTP/2
    # multiplexes their calls and watch streams): a thousand channels' poller threads
    # on two cores starved the lease keep-alives. Each agent keeps its own lease,
    # watch and mirror. Agents take the members in turn, as real agents' clients each
    # pick one of the listed endpoints at random.
    clients = [new_client(endpoint) for endpoint in endpoints]
    for index, name in enumerate(names):
        agent = SimAgent(endpoints[0], run_id, name, max_nodes, settle, ttl,
                         clients[(first_member + index) % len(clients)])
        agent.on_plan = lambda plan, name=name: updates.put((name, plan[0], plan[1], plan[2]))
        agents[name] = agent
    def run(name, agent):
        agent.run(go, monitor)
        if agent.error:
            updates.put((name, "error", agent.error, ()))

    for name, agent in agents.items():
        threading.Thread(target=run, args=(name, agent), daemon=True).start()
    updates.put((f"process {os.getpid()}", "ready", None, ()))
    while True:
        command = commands.recv()
        if command[0] == "leave":
            agents[command[1]].close(leave=True)
        else:
            break
    for agent in agents.values():
        agent.close(leave=False)
    os._exit(0)


class ProcessGroupAgents:
    """The parent's view: the newest plan each agent reported through a queue."""

    def __init__(self, endpoints: tuple[str, ...], run_id: str, n: int, processes: int, args,
                 monitor: bool):
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # no gRPC state inherited by fork
        self.updates = context.Queue()
        self.names = [f"s{i:04d}" for i in range(n)]
        self.last: dict[str, tuple] = {}
        self.errors: dict[str, str] = {}
        self.ready = 0  # children done importing and building their agents
        self.pipes, self.children, self.owner = [], [], {}
        go = time.time() + 3.0 + n / 200  # time for the children to import and connect
        self.go = go
        for index in range(processes):
            share = self.names[index::processes]
            parent_end, child_end = context.Pipe()
            child = context.Process(target=_group_main, daemon=True, args=(
                endpoints, index, run_id, share, n, args.settle, args.lease_ttl, go, monitor,
                self.updates, child_end))
            child.start()
            self.pipes.append(parent_end)
            self.children.append(child)
            self.owner.update({name: parent_end for name in share})

    def drain(self) -> None:
        while True:
            try:
                name, at, number, members = self.updates.get_nowait()
            except Exception:  # queue.Empty
                return
            if at == "error":
                self.errors[name] = number
            elif at == "ready":
                self.ready += 1
            else:
                self.last[name] = (at, number, tuple(members))

    def wait_ready(self) -> bool:
        """Until every child has imported and built its agents (or the start time):
        the start's CPU is then the rendezvous's, not Python's start-up."""
        while self.ready < len(self.children) and time.time() < self.go:
            self.drain()
            time.sleep(0.02)
        return self.ready == len(self.children)

    def wait_agreed(self, names, size: int, after_round: int, timeout: float):
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.drain()
            last = [self.last.get(name) for name in names]
            if all(p is not None and p[1] > after_round for p in last):
                if len({p[1] for p in last}) == 1 and len({p[2] for p in last}) == 1 \
                        and len(last[0][2]) == size:
                    return max(p[0] for p in last), last[0][1]
            time.sleep(0.05)
        return None

    def leave(self, name: str) -> None:
        self.owner[name].send(("leave", name))

    def stop(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("stop",))
            except OSError:
                pass
        for child in self.children:
            child.join(timeout=20)
            if child.is_alive():
                child.kill()


class Meter:
    """etcd's request counters and the CPU time of the agents' and etcd's processes;
    with several etcd members, each member's CPU as well as their sum."""

    def __init__(self, etcd_endpoints, agent_pids: list[int], etcd_pids: list[int],
                 proxy_pid: int | None = None, profilers: list | None = None):
        self.etcd_endpoints, self.agent_pids = tuple(etcd_endpoints), agent_pids
        self.etcd_pids, self.proxy_pid = list(etcd_pids), proxy_pid
        self.profilers = profilers or []  # etcd_profile.WindowProfiler per member

    def read(self) -> tuple:
        """(time, requests, agents' CPU, etcd's CPU, watch events, proxy CPU or None,
        each member's CPU)."""
        requests, events = scrape(self.etcd_endpoints)
        by_member = tuple(cpu_seconds([pid]) for pid in self.etcd_pids)
        return (time.time(), requests, cpu_seconds(self.agent_pids), sum(by_member), events,
                cpu_seconds([self.proxy_pid]) if self.proxy_pid else None, by_member)

    @staticmethod
    def phase(name: str, before, after, n: int, rounds: int) -> dict:
        requests = delta(before[1], after[1])
        per_round = max(rounds, 1)
        events = None if before[4] is None or after[4] is None else int(after[4] - before[4])
        proxy = {} if after[5] is None else {f"{name}_proxy_cpu_s": after[5] - before[5]}
        members = {} if len(after[6]) < 2 else {f"{name}_etcd_cpu_s_by_member": [
            round(b - a, 3) for a, b in zip(before[6], after[6])]}
        return {**proxy, **members, f"{name}_requests": requests,
                f"{name}_requests_total": sum(requests.values()),
                f"{name}_requests_per_agent_round": sum(requests.values()) / n / per_round,
                f"{name}_rounds": rounds,
                f"{name}_agent_cpu_ms_per_agent": 1000 * (after[2] - before[2]) / n,
                f"{name}_etcd_cpu_s": after[3] - before[3],
                f"{name}_watch_events": events,
                f"{name}_watch_events_per_round": None if events is None else events / per_round,
                f"{name}_watch_events_per_agent_round":
                    None if events is None else events / n / per_round}


def cpu_seconds(pids: list[int]) -> float:
    """user+system CPU of live processes, from /proc (Linux)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def last_registration(endpoint: str, run_id: str) -> float:
    from elastic_runner.rendezvous import protocol as p
    client = new_client(endpoint)
    kvs, _ = client.get_prefix(p.nodes_prefix(p.run_prefix(run_id)))
    client.close()
    return max((json.loads(kv.value).get("registered_at", 0.0) for kv in kvs), default=0.0)


def stored_sizes(endpoint: str, run_id: str, number: int) -> tuple[int | None, int | None]:
    """(round `number`'s plan as stored, the round key as its close left it) in bytes.
    Every agent receives the round key through its watch each round, so N x the
    second is what handing out one round costs etcd; the whole plan is read only by
    the deputies' copies and by an agent that lacks the previous plan."""
    from elastic_runner.rendezvous import protocol as p
    client = new_client(endpoint)
    try:
        plan = client.get(p.plan_key(p.run_prefix(run_id), number))
        round_kv = client.get(p.round_key(p.run_prefix(run_id)))
    finally:
        client.close()
    return (len(plan.value) if plan is not None else None,
            len(round_kv.value) if round_kv is not None else None)


@contextlib.contextmanager
def etcd_for_run(members: int, pprof: bool, binary: str | None = None):
    """One embedded member, or a cluster. A cluster gets etcd's default heartbeat
    (100 ms) and election timeout (1 s): the tests' 10 / 100 ms would let members
    starved by a thousand agents on two cores call elections mid-round."""
    from elastic_runner.etcd.server import EmbeddedEtcd, EmbeddedEtcdCluster
    profiling = ("--enable-pprof",) if pprof else ()
    if members == 1:
        with EmbeddedEtcd(binary=binary, extra_args=profiling) as etcd:
            yield [etcd]
        return
    with EmbeddedEtcdCluster(members, binary=binary, extra_args=(
            "--heartbeat-interval", "100", "--election-timeout", "1000", *profiling)) as cluster:
        yield cluster.members


@contextlib.contextmanager
def profiled(members, folder: Path | None):
    """Each member's back-to-back CPU profiles while the sizes run (--etcd-profile)."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(WindowProfiler(member.endpoint, folder / member.name))
               for member in members] if folder else []


@contextlib.contextmanager
def proxy_in_front(etcd_endpoints: tuple[str, ...], wanted: bool):
    """An etcd gRPC proxy for the agents to reach etcd through, when `wanted`; it lists
    every member, as a deployed proxy does."""
    if not wanted:
        yield None
        return
    from elastic_runner.etcd.proxy import EtcdGrpcProxy
    with EtcdGrpcProxy(etcd_endpoints) as proxy:
        yield proxy


# A writer that keeps the disk busy the way an unpacking install does: 64 MB, fsync,
# again, in place. etcd fsyncs its WAL on every write, so this is what reaches etcd.
_DISK_HOG = """
import os, sys
block = os.urandom(1 << 20)
with open(sys.argv[1], "wb") as out:
    while True:
        for _ in range(64):
            out.write(block)
        out.flush()
        os.fsync(out.fileno())
        out.seek(0)
"""


@contextlib.contextmanager
def machine_load(spinners: int, disk: bool):
    """`spinners` processes that spin on a core each, and with `disk` one that rewrites
    a file with fsync, for as long as the block runs: the load a package install or a
    neighbour's job puts on a shared machine, under which 1,024 agents once did not
    agree at all (issue 17). Started bound to this process, stopped by PID."""
    import shutil
    import subprocess
    import sys
    import tempfile

    from elastic_runner._process import bound_to_parent, stop_process
    scratch = Path(tempfile.mkdtemp(prefix="rdzv-load-"))
    commands = [[sys.executable, "-c", "while True: pass"]] * spinners
    commands += [[sys.executable, "-c", _DISK_HOG, str(scratch / "disk-hog")]] if disk else []
    hogs = [subprocess.Popen(bound_to_parent(command), stdin=subprocess.DEVNULL,
                             start_new_session=True) for command in commands]
    try:
        yield [hog.pid for hog in hogs]
    finally:
        for hog in hogs:
            stop_process(hog, 2.0)
        shutil.rmtree(scratch, ignore_errors=True)
