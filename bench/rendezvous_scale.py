"""Rendezvous at scale: N simulated agents (threads) against one real etcd, side by
side with torch's DynamicRendezvousHandler over a c10d TCPStore.

elastic-run: each simulated agent is an EtcdRendezvous with its own etcd client
(one gRPC channel, one watch, one kept lease), exactly as an agent holds them;
`register()` then `next_plan()`. Time = from the common start until every agent
holds the same closed plan. Then, at the largest N, every agent runs the agent's
monitor loop (change_reason / mirror wait, 0.1 s) and one agent leaves (lease
revoked, as on SIGTERM) and later one joins: time until all hold the next agreed
plan. etcd requests = delta of etcd's own Prometheus counter
grpc_server_msg_received_total (every gRPC request message: Range, Txn, Put,
LeaseGrant, LeaseKeepAlive, watch creates ...), per round and per agent.

torch: each simulated agent is a DynamicRendezvousHandler (torch defaults:
last call 30 s, close 30 s, keep-alive 5 s x 3) on a C10dRendezvousBackend with its
own TCPStore client to one TCPStore server; `next_rendezvous()`. A leave is a
crash (torch has no per-node graceful leave: shutdown() closes the whole
rendezvous) and survivors re-rendezvous at once, as torchrun does when its
workers fail; a join is a newcomer whose presence the members notice by polling
num_nodes_waiting() every 0.1 s (torchrun's monitor interval). Requests =
backend get_state/set_state calls (each one reads or writes the whole state).

    /work/venv/bin/python bench/rendezvous_scale.py                # N = 8, 64, 256
    /work/venv/bin/python bench/rendezvous_scale.py --big          # adds N = 1024
    /work/venv/bin/python bench/rendezvous_scale.py --sizes 8,64 --no-torch
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c  # noqa: E402

os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # no per-round MASTER_ADDR servers


def metrics(endpoint: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{endpoint}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("grpc_server_msg_received_total{"):
            method = re.search(r'grpc_method="([^"]+)"', line).group(1)
            out[method] = out.get(method, 0) + float(line.rsplit(" ", 1)[1])
    return out


def delta(a: dict, b: dict) -> dict:
    d = {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b)}
    return {k: int(v) for k, v in sorted(d.items()) if v}


# ---- elastic-run -----------------------------------------------------------------
class SimAgent:
    def __init__(self, endpoint: str, run_id: str, node: str, max_nodes: int, settle: float,
                 ttl: int):
        from elastic_runner.config import EtcdConfig, RendezvousConfig
        from elastic_runner.etcd.client import EtcdClient
        from elastic_runner.rendezvous.handler import EtcdRendezvous
        from elastic_runner.rendezvous.protocol import JobSpec
        self.client = EtcdClient(EtcdConfig((endpoint,), timeout_s=30.0, retry_deadline_s=60.0))
        cfg = RendezvousConfig(run_id=run_id, node_id=node, min_nodes=1, max_nodes=max_nodes,
                               lease_ttl_s=ttl, settle_s=settle, join_timeout_s=300)
        self.rdzv = EtcdRendezvous(self.client, cfg, JobSpec(1, max_nodes, "bench"), 3)
        self.plans: list[tuple[float, int, tuple]] = []
        self.on_plan = None  # set in --processes mode: reports each plan to the parent
        self.stop = threading.Event()
        self.error: str | None = None

    def run(self, go: float, monitor: bool) -> None:
        try:
            time.sleep(max(0.0, go - time.time()))
            self.rdzv.register()
            plan = self.rdzv.next_plan(None, "start")
            self._record(plan)
            while monitor and not self.stop.is_set():
                gen = self.rdzv.mirror.generation
                reason = self.rdzv.change_reason(plan)
                if reason:
                    plan = self.rdzv.next_plan(plan, reason)
                    self._record(plan)
                else:
                    self.rdzv.mirror.wait(0.1, gen)
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


def elastic_size(endpoint: str, n: int, churn: bool, args) -> dict:
    run_id = f"scale-{n}-{os.getpid()}-{int(time.time())}"
    t_build = time.time()
    agents = [SimAgent(endpoint, run_id, f"s{i:04d}", n, args.settle, args.lease_ttl)
              for i in range(n)]
    build_s = time.time() - t_build
    go = time.time() + 0.5
    m0 = metrics(endpoint)
    threads = [threading.Thread(target=a.run, args=(go, churn), daemon=True) for a in agents]
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


# ---- elastic-run, agents spread over processes --------------------------------------
def _group_main(endpoint, run_id, names, max_nodes, settle, ttl, go, monitor, updates,
                commands) -> None:
    """One child process: its share of the simulated agents, as threads."""
    agents = {}
    for name in names:
        agent = SimAgent(endpoint, run_id, name, max_nodes, settle, ttl)
        agent.on_plan = lambda plan, name=name: updates.put((name, plan[0], plan[1], plan[2]))
        agents[name] = agent
    for agent in agents.values():
        threading.Thread(target=agent.run, args=(go, monitor), daemon=True).start()
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

    def __init__(self, endpoint: str, run_id: str, n: int, processes: int, args, monitor: bool):
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # no gRPC state inherited by fork
        self.updates = context.Queue()
        self.names = [f"s{i:04d}" for i in range(n)]
        self.last: dict[str, tuple] = {}
        self.pipes, self.children, self.owner = [], [], {}
        go = time.time() + 3.0 + n / 200  # time for the children to import and connect
        self.go = go
        for index in range(processes):
            share = self.names[index::processes]
            parent_end, child_end = context.Pipe()
            child = context.Process(target=_group_main, daemon=True, args=(
                endpoint, run_id, share, n, args.settle, args.lease_ttl, go, monitor,
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
            self.last[name] = (at, number, tuple(members))

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


def elastic_size_processes(endpoint: str, n: int, churn: bool, args) -> dict:
    run_id = f"scale-{n}-{os.getpid()}-{int(time.time())}"
    m0 = metrics(endpoint)
    group = ProcessGroupAgents(endpoint, run_id, n, args.processes, args, churn)
    res = {"n": n, "processes": args.processes}
    try:
        got = group.wait_agreed(group.names, n, -1, args.timeout + (group.go - time.time()))
        m1 = metrics(endpoint)
        res.update(start_s=got[0] - group.go if got else None, start_requests=delta(m0, m1))
        res["start_requests_total"] = sum(res["start_requests"].values())
        res["start_requests_per_agent"] = res["start_requests_total"] / n
        if got and churn:
            time.sleep(2.0)
            leaver = group.names[n // 2]
            rest = [name for name in group.names if name != leaver]
            m2, t_leave = metrics(endpoint), time.time()
            group.leave(leaver)
            got2 = group.wait_agreed(rest, n - 1, got[1], args.timeout)
            m3 = metrics(endpoint)
            res.update(leave_s=got2[0] - t_leave if got2 else None, leave_requests=delta(m2, m3))
            res["leave_requests_total"] = sum(res["leave_requests"].values())
            if got2:
                time.sleep(2.0)
                newcomer = SimAgent(endpoint, run_id, "new0", n, args.settle, args.lease_ttl)
                m4, t_join = metrics(endpoint), time.time()
                threading.Thread(target=newcomer.run, args=(t_join, True), daemon=True).start()
                newcomer.on_plan = lambda plan: group.updates.put(("new0", *plan))
                got3 = group.wait_agreed(rest + ["new0"], n, got2[1], args.timeout)
                m5 = metrics(endpoint)
                res.update(join_s=got3[0] - t_join if got3 else None,
                           join_requests=delta(m4, m5))
                res["join_requests_total"] = sum(res["join_requests"].values())
                newcomer.close(leave=False)
    finally:
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
    threads = [threading.Thread(target=a.run, args=(go, churn, ev), daemon=True)
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
    largest = max(sizes)
    info = c.env_info()
    started = time.time()
    er_res, tr_res, servers = {}, {}, []
    with EmbeddedEtcd() as etcd:
        for n in sizes:
            print(f"elastic-run N={n} ...", flush=True)
            measure = elastic_size_processes if args.processes else elastic_size
            er_res[n] = measure(etcd.endpoint, n, n == largest, args)
            print(f"  {er_res[n]}", flush=True)
    if not args.no_torch:
        for n in sizes:
            if n > args.torch_max:
                tr_res[n] = {"n": n, "skipped": f"above --torch-max {args.torch_max}"}
                continue
            print(f"torch N={n} ...", flush=True)
            tr_res[n] = torch_size(n, n == min(largest, args.torch_max), args)
            servers.append(tr_res[n].pop("_server"))
            print(f"  {tr_res[n]}", flush=True)

    rows = []
    for n in sizes:
        e, t = er_res[n], tr_res.get(n, {})
        r = c.ratio(e.get("start_s"), t.get("start_s"))
        rows.append([f"start, N={n}", c.fmt(e.get("start_s"), "s", 2),
                     f"{e.get('start_requests_total', 0)} ({e.get('start_requests_per_agent', 0):.1f}/agent)",
                     t.get("skipped") or c.fmt(t.get("start_s"), "s", 2),
                     f"{t.get('start_requests_total', 0)} ({t.get('start_requests_per_agent', 0):.1f}/agent)"
                     if "start_requests_total" in t else "n/a",
                     f"{r:.2f}" if r else "n/a"])
    for ev in ("leave", "join"):
        e = er_res[largest]
        nt = min(largest, args.torch_max)
        t = tr_res.get(nt, {})
        r = c.ratio(e.get(f"{ev}_s"), t.get(f"{ev}_s"))
        rows.append([f"one {ev} at N={largest}" + (f" (torch N={nt})" if nt != largest else ""),
                     c.fmt(e.get(f"{ev}_s"), "s", 2), str(e.get(f"{ev}_requests_total", "n/a")),
                     c.fmt(t.get(f"{ev}_s"), "s", 2) if t else "n/a",
                     str(t.get(f"{ev}_requests_total", "n/a")), f"{r:.2f}" if r else "n/a"])
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
            + c.table(["event", "elastic-run (etcd)", "etcd requests", "torch c10d dynamic",
                       "backend state reads+writes", "ratio er/torch"], rows)
            + growth + f"\nwall time {time.time() - started:.0f}s")
    print("\n" + text)
    path = c.save("rendezvous_scale", {"args": vars(args), "env": info, "elastic_run": er_res,
                                       "torch": tr_res}, text)
    print(f"wrote {path} and {c.LATEST / 'rendezvous_scale.json'}")
    os._exit(0)  # daemon threads of hundreds of clients: do not wait for their teardown


if __name__ == "__main__":
    main()
