"""The tables and summary lines of rendezvous_scale.py, from its results: one module
for measuring and one for saying what was measured."""

from __future__ import annotations

import time

import common as c


def _num(value, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def _proxy_cell(res: dict, event: str) -> str:
    proxy = res.get(f"{event}_proxy_cpu_s")
    return "" if proxy is None else f" (+{proxy:.2f} s proxy)"


def _members_cell(res: dict, event: str) -> str:
    """Each member's share where etcd is a cluster; * marks the leader at the start."""
    by_member = res.get(f"{event}_etcd_cpu_s_by_member")
    if not by_member:
        return ""
    leader = (res.get("etcd_leader_before_after") or [None])[0]
    return " (" + " / ".join(f"{used:.2f}{'*' if index == leader else ''}"
                             for index, used in enumerate(by_member)) + ")"


def table_rows(sizes: list[int], er_res: dict, tr_res: dict) -> list[list[str]]:
    rows = []
    for event in ("start", "leave", "join"):
        for n in sizes:
            e, t = er_res[n], tr_res.get(n, {})
            if f"{event}_s" not in e and event != "start":
                continue
            r = c.ratio(e.get(f"{event}_s"), t.get(f"{event}_s"))
            per_round = e.get(f"{event}_requests_per_agent_round")
            events = e.get(f"{event}_watch_events_per_round")
            tr_total = t.get(f"{event}_requests_total")
            rows.append([
                f"{event}, N={n}", c.fmt(e.get(f"{event}_s"), "s", 2),
                _num(e.get(f"{event}_rounds"), "d"),
                _num(e.get(f"{event}_agent_cpu_ms_per_agent"), ".0f", " ms"),
                _num(e.get(f"{event}_etcd_cpu_s"), ".2f", " s") + _proxy_cell(e, event)
                + _members_cell(e, event),
                f"{per_round:.1f}" if per_round is not None else
                f"{e.get(f'{event}_requests_total', 0)} total",
                "-" if events is None else
                f"{events:,.0f} ({e[f'{event}_watch_events_per_agent_round']:.1f})",
                _num(e.get("plan_bytes" if event == "start" else f"{event}_plan_bytes"), ",d"),
                _num(e.get(f"{event}_round_key_bytes"), ",d"),
                t.get("skipped") or (c.fmt(t.get(f"{event}_s"), "s", 2) if t else "n/a"),
                f"{tr_total / n:.1f}" if tr_total else "n/a",
                f"{r:.2g}" if r else "n/a"])
    return rows


def growth_line(sizes: list[int], er_res: dict, tr_res: dict) -> str:
    if len(sizes) < 2:
        return ""
    a, b = sizes[0], sizes[-1]
    ea, eb = er_res[a]["start_requests_total"], er_res[b]["start_requests_total"]
    growth = (f"\netcd requests for the start round grow x{eb / max(ea, 1):.1f} for N x{b / a:.0f} "
              f"({ea / a:.1f} -> {eb / b:.1f} per agent)")
    wa, wb = (er_res[x].get("start_watch_events_per_round") for x in (a, b))
    if wa is not None and wb is not None:
        growth += (f"; watch events per start round x{wb / max(wa, 1):.1f} "
                   f"({wa / a:.1f} -> {wb / b:.1f} per agent)")
    if a in tr_res and b in tr_res and "start_requests_total" in tr_res[b]:
        ta, tb = tr_res[a]["start_requests_total"], tr_res[b]["start_requests_total"]
        growth += (f"; torch backend state reads+writes grow x{tb / max(ta, 1):.1f} "
                   f"({ta / a:.1f} -> {tb / b:.1f} per agent), state bytes moved "
                   f"{tr_res[a]['start_requests'].get('bytes', 0) / 1e6:.2f} MB -> "
                   f"{tr_res[b]['start_requests'].get('bytes', 0) / 1e6:.1f} MB")
    return growth


def idle_line(sizes: list[int], er_res: dict) -> str:
    """Each size's idle CPU, and its phases' CPU less that idle share (the round's work)."""
    parts = []
    for n in sizes:
        res, rate = er_res[n], er_res[n].get("idle_agent_cpu_ms_per_agent_s")
        if rate is None:
            continue
        work = [f"{name} {res[f'{name}_agent_cpu_ms_per_agent'] - rate * res[f'{name}_s']:.1f}"
                for name in ("start", "leave", "join") if res.get(f"{name}_s") is not None]
        setup = res.get("setup_agent_cpu_ms_per_agent")
        setup = "" if setup is None else (f"; before the start (Python, imports, clients; "
                                          f"not counted in start): {setup:.1f} ms per agent")
        parts.append(f"N={n}: idle {rate:.2f} ms per agent per s; per agent per round less "
                     f"idle ticks (ms): {', '.join(work)}{setup}")
    return ("\n" + "\n".join(parts)) if parts else ""


def profile_line(sizes: list[int], er_res: dict) -> str:
    """Each phase's etcd CPU by category, from etcd's own profiles (--etcd-profile)."""
    parts = []
    for n in sizes:
        for name in ("start", "leave", "join"):
            profile = er_res[n].get(f"{name}_etcd_profile")
            if profile and profile["shares"]:
                split = ", ".join(f"{category} {100 * share:.0f} %"
                                  for category, share in profile["shares"].items())
                parts.append(f"N={n} {name}: {split} "
                             f"({profile['sampled_cpu_s']:.2f} s sampled)")
    return ("\netcd CPU by category (Go profiles):\n" + "\n".join(parts)) if parts else ""


def report(args, sizes, er_res, tr_res, info, started) -> str:
    spread = (f"in up to {args.processes} processes (one per agent at most)" if args.processes
              else "in one process")
    ttls = sorted({er_res[n]["lease_ttl"] for n in sizes})
    ttl = (f"{ttls[0]}s" if len(ttls) == 1 else
           "by N " + ", ".join(f"{n}: {er_res[n]['lease_ttl']}s" for n in sizes))
    route = ("; elastic-run's agents reach etcd through one etcd grpc-proxy (etcd CPU is "
             "etcd's alone; the proxy's in brackets)" if args.grpc_proxy else "")
    if getattr(args, "cpu_hogs", 0) or getattr(args, "disk_hog", False):
        route += (f"; alongside, {args.cpu_hogs} processes spinning on a core each"
                  + (" and one rewriting 64 MB with fsync in a loop" if args.disk_hog else ""))
    if getattr(args, "etcd_members", 1) > 1:
        route += (f"; etcd is a cluster of {args.etcd_members} members, the agents spread over "
                  "them in turn (etcd CPU: all members together, each member's in brackets, "
                  "* the leader)")
    return (f"rendezvous_scale: simulated agents as threads {spread}, loopback{route}; "
            f"elastic-run settle {args.settle}s, lease TTL {ttl}; torch defaults\n"
            f"{info['date_utc']} UTC, {info['cores']} cores, torch {info['torch']}, etcd {info['etcd']}\n\n"
            + c.table(["event", "elastic-run (etcd)", "rounds", "CPU per agent", "etcd CPU",
                       "etcd requests per agent per round",
                       "watch events per round (per agent)", "plan bytes",
                       "round key bytes (to every agent)", "torch c10d dynamic",
                       "torch state reads+writes per agent", "ratio er/torch"],
                      table_rows(sizes, er_res, tr_res))
            + growth_line(sizes, er_res, tr_res) + idle_line(sizes, er_res)
            + profile_line(sizes, er_res)
            + "\nelastic-run's times are bounded by this machine: all N simulated agents share "
            f"{info['cores']} cores, so a round takes about N x (CPU per agent) / cores; an "
            "agent on its own machine spends the CPU per agent shown."
            + f"\nwall time {time.time() - started:.0f}s")
