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
LeaseGrant, LeaseKeepAlive, watch creates ...), per agent per round.

All N agents share this machine's cores, so elastic-run's wall times here are about
N x (CPU per agent) / cores; at N=1024 on 2 cores the lease keep-alives of agents
starved of CPU took 20-30 s, so that size needs --lease-ttl 120 (a leave revokes its
lease, so the TTL does not enter the figures).

torch: each simulated agent is a DynamicRendezvousHandler (torch defaults:
last call 30 s, close 30 s, keep-alive 5 s x 3) on a C10dRendezvousBackend with its
own TCPStore client to one TCPStore server; `next_rendezvous()`. A leave is a
crash (torch has no per-node graceful leave: shutdown() closes the whole
rendezvous) and survivors re-rendezvous at once, as torchrun does when its
workers fail; a join is a newcomer whose presence the members notice by polling
num_nodes_waiting() every 0.1 s (torchrun's monitor interval). Requests =
backend get_state/set_state calls (each one reads or writes the whole state).

    .venv/bin/python bench/rendezvous_scale.py --processes 8                # N = 8, 64, 256
    .venv/bin/python bench/rendezvous_scale.py --processes 8 --big --lease-ttl 120
    .venv/bin/python bench/rendezvous_scale.py --sizes 8,64 --no-torch
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
from rdzv_agents import (  # noqa: E402
    Meter, ProcessGroupAgents, SimAgent, delta, last_registration, metrics, wait_agreed,
)

os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # no per-round MASTER_ADDR servers


# ---- elastic-run -----------------------------------------------------------------
def elastic_size(endpoint: str, n: int, churn: bool, args) -> dict:
    run_id = f"scale-{n}-{os.getpid()}-{int(time.time())}"
    t_build = time.time()
    agents = [SimAgent(endpoint, run_id, f"s{i:04d}", n, args.settle, args.lease_ttl)
              for i in range(n)]
    build_s = time.time() - t_build
    go = time.time() + 0.5
    m0 = metrics(endpoint)
    threads = [threading.Thread(target=a.run, args=(go, True), daemon=True) for a in agents]
    for t in threads:
        t.start()
    got = wait_agreed(agents, n, -1, args.timeout)
    m1 = metrics(endpoint)
    res = {"n": n, "clients_connect_s": build_s,
           "start_s": got[0] - go if got else None,
           "start_requests": delta(m0, m1),
           "errors": [a.error for a in agents if a.error][:3]}
    res["start_requests_total"] = sum(res["start_requests"].values())
    res["start_requests_per_agent"] = res["start_requests_total"] / n
    if got and churn:
        time.sleep(1.0)
        r0 = got[1]
        leaver = agents[n // 2]
        m2 = metrics(endpoint)
        t_leave = time.time()
        leaver.close(leave=True)
        rest = [a for a in agents if a is not leaver]
        got2 = wait_agreed(rest, n - 1, r0, args.timeout)
        m3 = metrics(endpoint)
        res["leave_s"] = got2[0] - t_leave if got2 else None
        res["leave_requests"] = delta(m2, m3)
        res["leave_requests_total"] = sum(res["leave_requests"].values())
        if got2:
            time.sleep(1.0)
            newcomer = SimAgent(endpoint, run_id, "new0", n, args.settle, args.lease_ttl)
            m4 = metrics(endpoint)
            t_join = time.time()
            th = threading.Thread(target=newcomer.run, args=(t_join, True), daemon=True)
            th.start()
            rest.append(newcomer)
            agents.append(newcomer)
            got3 = wait_agreed(rest, n, got2[1], args.timeout)
            m5 = metrics(endpoint)
            res["join_s"] = got3[0] - t_join if got3 else None
            res["join_requests"] = delta(m4, m5)
            res["join_requests_total"] = sum(res["join_requests"].values())
        res["errors"] = [a.error for a in agents if a.error][:3]
    for a in agents:
        a.close(leave=False)
    for a in agents:
        try:
            a.client.close()
        except Exception:  # noqa: BLE001
            pass
    return res


def elastic_size_processes(endpoint: str, n: int, churn: bool, args) -> dict:
    """Start, then (churn) one leave and one join; each phase timed, counted and CPU-metered."""
    run_id = f"scale-{n}-{os.getpid()}-{int(time.time())}"
    res = {"n": n, "processes": args.processes}
    group = ProcessGroupAgents(endpoint, run_id, n, args.processes, args, True)
    meter = Meter(endpoint, [child.pid for child in group.children], args.etcd_pid)
    try:
        m0 = meter.read()
        got = group.wait_agreed(group.names, n, -1, args.timeout + (group.go - time.time()))
        res.update(meter.phase("start", m0, meter.read(), n, got[1] + 1 if got else 0))
        res["start_s"] = got[0] - group.go if got else None
        res["start_requests_per_agent"] = res["start_requests_total"] / n
        res["start_last_registration_s"] = last_registration(endpoint, run_id) - group.go
        if got and churn:
            time.sleep(2.0)
            leaver = group.names[n // 2]
            rest = [name for name in group.names if name != leaver]
            m2 = meter.read()
            group.leave(leaver)
            got2 = group.wait_agreed(rest, n - 1, got[1], args.timeout)
            res.update(meter.phase("leave", m2, meter.read(), n - 1,
                                   got2[1] - got[1] if got2 else 0))
            res["leave_s"] = got2[0] - m2[0] if got2 else None
            if got2:
                time.sleep(2.0)
                newcomer = SimAgent(endpoint, run_id, "new0", n, args.settle, args.lease_ttl)
                newcomer.on_plan = lambda plan: group.updates.put(("new0", *plan))
                m4 = meter.read()
                threading.Thread(target=newcomer.run, args=(m4[0], True), daemon=True).start()
                got3 = group.wait_agreed(rest + ["new0"], n, got2[1], args.timeout)
                res.update(meter.phase("join", m4, meter.read(), n,
                                       got3[1] - got2[1] if got3 else 0))
                res["join_s"] = got3[0] - m4[0] if got3 else None
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,64,256")
    ap.add_argument("--big", action="store_true", help="also N=1024")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--torch-max", type=int, default=256, help="largest N tried with torch")
    ap.add_argument("--timeout", type=float, default=150)
    ap.add_argument("--settle", type=float, default=1.0)
    ap.add_argument("--lease-ttl", type=int, default=5)
    ap.add_argument("--processes", type=int, default=0,
                    help="spread elastic-run's simulated agents over this many processes "
                         "(0: threads in this process); needed for N >= 256 on small machines")
    args = ap.parse_args()
    from elastic_runner.etcd.server import EmbeddedEtcd

    sizes = [int(s) for s in args.sizes.split(",")] + ([1024] if args.big else [])
    info = c.env_info()
    started = time.time()
    er_res, tr_res, servers = {}, {}, []
    with EmbeddedEtcd() as etcd:
        args.etcd_pid = etcd.process.pid
        for n in sizes:
            print(f"elastic-run N={n} ...", flush=True)
            measure = elastic_size_processes if args.processes else elastic_size
            er_res[n] = measure(etcd.endpoint, n, True, args)
            print(f"  {er_res[n]}", flush=True)
    if not args.no_torch:
        for n in sizes:
            if n > args.torch_max:
                tr_res[n] = {"n": n, "skipped": f"above --torch-max {args.torch_max}"}
                continue
            print(f"torch N={n} ...", flush=True)
            tr_res[n] = torch_size(n, True, args)
            servers.append(tr_res[n].pop("_server"))
            print(f"  {tr_res[n]}", flush=True)

    rows = []
    for event in ("start", "leave", "join"):
        for n in sizes:
            e, t = er_res[n], tr_res.get(n, {})
            if f"{event}_s" not in e and event != "start":
                continue
            r = c.ratio(e.get(f"{event}_s"), t.get(f"{event}_s"))
            rounds = e.get(f"{event}_rounds")
            cpu = e.get(f"{event}_agent_cpu_ms_per_agent")
            per_round = e.get(f"{event}_requests_per_agent_round")
            etcd_cpu = e.get(f"{event}_etcd_cpu_s")
            tr_total = t.get(f"{event}_requests_total")
            rows.append([
                f"{event}, N={n}", c.fmt(e.get(f"{event}_s"), "s", 2),
                str(rounds) if rounds is not None else "-",
                f"{cpu:.0f} ms" if cpu is not None else "-",
                f"{etcd_cpu:.2f} s" if etcd_cpu is not None else "-",
                f"{per_round:.1f}" if per_round is not None else
                f"{e.get(f'{event}_requests_total', 0)} total",
                t.get("skipped") or (c.fmt(t.get(f"{event}_s"), "s", 2) if t else "n/a"),
                f"{tr_total / n:.1f}" if tr_total else "n/a",
                f"{r:.2g}" if r else "n/a"])
    growth = ""
    if len(sizes) >= 2:
        a, b = sizes[0], sizes[-1]
        ea, eb = er_res[a]["start_requests_total"], er_res[b]["start_requests_total"]
        growth = (f"\netcd requests for the start round grow x{eb / max(ea, 1):.1f} for N x{b / a:.0f} "
                  f"({ea / a:.1f} -> {eb / b:.1f} per agent)")
        if a in tr_res and b in tr_res and "start_requests_total" in tr_res[b]:
            ta, tb = tr_res[a]["start_requests_total"], tr_res[b]["start_requests_total"]
            growth += (f"; torch backend state reads+writes grow x{tb / max(ta, 1):.1f} "
                       f"({ta / a:.1f} -> {tb / b:.1f} per agent), state bytes moved "
                       f"{tr_res[a]['start_requests'].get('bytes', 0) / 1e6:.2f} MB -> "
                       f"{tr_res[b]['start_requests'].get('bytes', 0) / 1e6:.1f} MB")
    spread = (f"in {args.processes} processes" if args.processes else "in one process")
    text = (f"rendezvous_scale: simulated agents as threads {spread}, loopback; "
            f"elastic-run settle {args.settle}s, lease TTL {args.lease_ttl}s; torch defaults\n"
            f"{info['date_utc']} UTC, {info['cores']} cores, torch {info['torch']}, etcd {info['etcd']}\n\n"
            + c.table(["event", "elastic-run (etcd)", "rounds", "CPU per agent", "etcd CPU",
                       "etcd requests per agent per round", "torch c10d dynamic",
                       "torch state reads+writes per agent", "ratio er/torch"], rows)
            + growth
            + "\nelastic-run's times are bounded by this machine: all N simulated agents share "
            f"{info['cores']} cores, so a round takes about N x (CPU per agent) / cores; an "
            "agent on its own machine spends the CPU per agent shown."
            + f"\nwall time {time.time() - started:.0f}s")
    print("\n" + text)
    path = c.save("rendezvous_scale", {"args": vars(args), "env": info, "elastic_run": er_res,
                                       "torch": tr_res}, text)
    print(f"wrote {path} and {c.LATEST / 'rendezvous_scale.json'}")
    os._exit(0)  # daemon threads of hundreds of clients: do not wait for their teardown


if __name__ == "__main__":
    main()
