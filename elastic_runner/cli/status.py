"""`elastic-run status`: what a run looks like right now, read from etcd alone.

Why etcd only: it is the one component every node and every operator can reach,
and it already holds the truth (spec, round, plan, live nodes under their
leases, the newest checkpoint, a bounded copy of the event log). Nothing here
writes to etcd.

Choices written down here:
- While a round is open, the members shown are those of the last closed plan
  (the workers that ran last), and the round state says "open".
- "joined" is when the node registered (its node key's registered_at, that
  machine's clock; a `joined` event for agents that predate it), else the etcd
  revision that created its node key.
- A checkpoint's age is shown only when its record carries a time; the current
  record (url, step, sha256, world size) does not, so it is usually omitted.
- Without --run-id every run under the schema prefix is listed. That reads the
  whole prefix once: fine for an operator's command, not for a tight loop.
- --watch re-renders when a key under the run's prefix changes (one etcd watch
  feeding a queue), never on a timer; torch's store keys are ignored.
"""

from __future__ import annotations

import argparse
import json
import queue
import time

from elastic_runner.cli.flags import (
    ETCD_ACCESS, ETCD_TIMEOUT, add_flags, apply_env_defaults, flag, parse_checked,
    parse_endpoints, read_password,
)
from elastic_runner.config import EtcdConfig
from elastic_runner.errors import ConfigError, RendezvousError
from elastic_runner.etcd.endpoints import parse_endpoint
from elastic_runner.rendezvous import protocol as p
from elastic_runner.validation import check_id, check_number, check_tls_files

# The launcher's etcd flags, plus what only status has; ELASTIC_RUN_* sets each.
STATUS_FLAGS = (
    flag("--rdzv-endpoints", "--rdzv-endpoint", help="etcd v3 URLs of the run"),
    flag("--run-id", "--rdzv-id", help="the run to show (default: list runs)"),
    ETCD_TIMEOUT, *ETCD_ACCESS,
    flag("--json", action="store_true", help="print one JSON object per view"),
    flag("--watch", action="store_true",
         help="re-render whenever the run changes in etcd (Ctrl-C to stop)"),
    flag("--events", type=int, default=10, help="recent events to show"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-run status", allow_abbrev=False,
                                     description="Show a run (or list runs) from etcd.")
    add_flags(parser, STATUS_FLAGS)
    return parser


def etcd_config(args, environ: dict[str, str]) -> EtcdConfig:
    endpoints = parse_endpoints(args.rdzv_endpoints)
    if not endpoints:
        raise ConfigError("--rdzv-endpoints is required: give the etcd URLs the run uses")
    for endpoint in endpoints:
        parse_endpoint(endpoint)
    if args.run_id:
        check_id(args.run_id, "--run-id")
    check_number("etcd_timeout", args.etcd_timeout)
    check_tls_files(args.etcd_cacert, args.etcd_cert, args.etcd_key)
    return EtcdConfig.build(endpoints, args.etcd_timeout, cacert=args.etcd_cacert,
                            cert=args.etcd_cert, key=args.etcd_key, user=args.etcd_user,
                            password=read_password(args, environ))


# ---- reading etcd ---------------------------------------------------------------
def run_prefix(run_id: str) -> str:
    return p.run_prefix(run_id)


def _json(kv) -> dict | None:
    try:
        return json.loads(kv.value) if kv is not None else None
    except json.JSONDecodeError:
        return None


def _text(kv) -> str | None:
    """A token-like value (letters and digits); anything else shown as unreadable,
    never as markup or a second line."""
    value = kv.value.decode(errors="replace") if kv is not None else None
    return value if value is None or value.isalnum() else "(unreadable)"


def list_runs(client) -> list[dict]:
    """Every run under the schema prefix with its round, state and world size."""
    entries, _ = client.get_prefix(f"{p.SCHEMA_PREFIX}/")
    runs: dict[str, dict] = {}
    plans: dict[tuple[str, int], dict] = {}
    for kv in entries:
        split = p.split_run_key(kv.key)
        if split is None:
            continue
        run_id, rest = split
        row = runs.setdefault(run_id, {"run_id": run_id, "round": None, "state": None,
                                       "world_size": None, "nodes": 0})
        if rest == "round":
            state = _json(kv) or {}
            row["round"], row["state"] = state.get("number"), state.get("state")
        elif rest.startswith("nodes/"):
            row["nodes"] += 1
        elif rest.endswith("/plan") and p.round_of(rest) is not None:
            plans[(run_id, p.round_of(rest))] = _json(kv) or {}
    for (run_id, number), plan in plans.items():
        row = runs[run_id]
        latest = row.get("_plan_round", -1)
        if number > latest and (row["round"] is None or number <= row["round"]):
            row["_plan_round"], row["world_size"] = number, plan.get("world_size")
    return [{k: v for k, v in row.items() if not k.startswith("_")}
            for _, row in sorted(runs.items())]


def _members(client, plan: p.Plan | None, nodes: dict, joined_at: dict) -> list[dict]:
    rows = []
    for member in plan.members if plan else ():
        kv = nodes.get(member.node_id)
        rows.append({
            "node": member.node_id, "addr": member.addr, "nproc": member.nproc,
            "node_rank": member.node_rank, "labels": dict(member.labels),
            "ranks": list(range(member.first_rank, member.first_rank + member.nproc)),
            "live": kv is not None,
            "joined_at": joined_at.get(member.node_id),
            "joined_revision": kv.create_revision if kv else None,
            "lease_remaining_s": _lease_left(client, kv),
        })
    return rows


def _lease_left(client, kv) -> int | None:
    if kv is None or not kv.lease:
        return None
    remaining = client.lease_remaining(kv.lease)
    return remaining if remaining >= 0 else None


def _checkpoint(client, prefix: str, now: float) -> dict | None:
    record = _json(client.get(p.checkpoint_key(prefix)))
    if record is None:
        return None
    if record.get("sha256") is None:  # checkpoint_latest.NO_CHECKPOINT: the newest rotted
        return {"step": None, "url": None, "retracted": True}
    found = {"step": record.get("step"), "url": record.get("url"),
             "world_size": record.get("world_size")}
    if isinstance(record.get("time"), (int, float)):
        found["age_s"] = round(now - record["time"], 1)
    return found


def run_status(client, run_id: str, events: int = 10) -> dict:
    """The run's current picture as plain data (the --json output).

    Raises:
        RendezvousError: nothing of this run is in etcd.
    """
    prefix = run_prefix(run_id)
    spec_kv, round_kv = client.get(p.spec_key(prefix)), client.get(p.round_key(prefix))
    if spec_kv is None and round_kv is None:
        raise RendezvousError(f"run {run_id!r} not found in etcd under {prefix}; "
                              "run `elastic-run status --rdzv-endpoints URLS` to list runs")
    state = p.RoundState.from_json(round_kv.value) if round_kv else None
    plan = _current_plan(client, prefix, state)
    node_kvs, _ = client.get_prefix(p.nodes_prefix(prefix))
    nodes = {p.node_id_from_key(kv.key): kv for kv in node_kvs}
    event_kvs, _ = client.get_prefix(p.events_prefix(prefix))
    all_events = [e for e in (_json(kv) for kv in event_kvs) if e is not None]
    # When each node registered, from its node key; a `joined` event in etcd is from an
    # agent older than event_copy.py, which no longer copies it.
    joined_at = {e.get("node"): e.get("time") for e in all_events if e.get("kind") == "joined"}
    joined_at.update({node: record["registered_at"] for node, record in
                      ((node, _json(kv) or {}) for node, kv in nodes.items())
                      if isinstance(record.get("registered_at"), (int, float))})
    in_plan = set(plan.node_ids) if plan else set()
    return {
        "run_id": run_id,
        "origin": _text(client.get(p.origin_key(prefix))),  # which launch: folder_claim.py
        "spec": _json(spec_kv),
        "round": state.number if state else None,
        "state": state.state if state else None,
        "cause": state.cause if state else None,
        "plan_round": plan.round if plan else None,
        "world_size": plan.world_size if plan else 0,
        "master": f"{plan.master_addr}:{plan.master_port}" if plan else None,
        "restart_count": plan.restart_count if plan else 0,
        "members": _members(client, plan, nodes, joined_at),
        "waiting": [{"node": node, **(_json(kv) or {}), "joined_at": joined_at.get(node),
                     "lease_remaining_s": _lease_left(client, kv)}
                    for node, kv in sorted(nodes.items()) if node not in in_plan],
        "checkpoint": _checkpoint(client, prefix, time.time()),
        "events": all_events[-events:] if events > 0 else [],
    }


def _current_plan(client, prefix: str, state: p.RoundState | None) -> p.Plan | None:
    """The plan of the current round if closed, else of the newest closed one before it."""
    if state is None:
        return None
    for number in range(state.number, max(state.number - 2, -1), -1):
        kv = client.get(p.plan_key(prefix, number))
        plan = p.plan_from(kv.value) if kv is not None else None
        if plan is not None:
            return plan
    return None


# ---- rendering ------------------------------------------------------------------
def _when(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else ""


def _event_text(event: dict) -> str:
    skip = {"time", "run_id", "node", "kind", "master", "pids"}
    fields = {k: v for k, v in sorted(event.items()) if k not in skip and v is not None}
    if isinstance(fields.get("members"), list):
        fields["members"] = ",".join(str(m.get("node")) for m in fields["members"])
    return " ".join(f"{k}={v}" for k, v in fields.items())[:120]


def render_status(console, status: dict) -> None:
    from rich.table import Table

    ckpt = status["checkpoint"]
    origin = f" (origin {status['origin']})" if status.get("origin") else ""
    head = (f"[bold]{status['run_id']}[/]{origin} round {status['round']} "
            f"[bold]{status['state']}[/]"
            f" ({status['cause']}), world size {status['world_size']}, master "
            f"{status['master']}, restarts {status['restart_count']}")
    console.print(head)
    if ckpt and ckpt.get("retracted"):
        console.print("checkpoint: none verified (the newest failed verification and was "
                      "retracted)")
    elif ckpt:
        age = f", {ckpt['age_s']:g} s ago" if "age_s" in ckpt else ""
        console.print(f"checkpoint: step {ckpt['step']} at {ckpt['url']}{age}")
    members = Table(title=f"members (plan of round {status['plan_round']})")
    for column in ("node", "labels", "addr", "nproc", "node rank", "ranks", "joined",
                   "lease left"):
        members.add_column(column)
    for m in status["members"]:
        lease = f"{m['lease_remaining_s']} s" if m["lease_remaining_s"] is not None else "gone"
        ranks = f"{m['ranks'][0]}..{m['ranks'][-1]}" if m["ranks"] else ""
        joined = _when(m["joined_at"]) or f"rev {m['joined_revision']}"
        labels = ",".join(f"{k}={v}" for k, v in sorted(m["labels"].items()))
        members.add_row(m["node"], labels, m["addr"], str(m["nproc"]), str(m["node_rank"]),
                        ranks, joined, lease)
    console.print(members)
    if status["waiting"]:
        waiting = Table(title="waiting (live, not in the plan)")
        for column in ("node", "addr", "nproc", "lease left"):
            waiting.add_column(column)
        for w in status["waiting"]:
            waiting.add_row(w["node"], str(w.get("addr", "")), str(w.get("nproc", "")),
                            f"{w['lease_remaining_s']} s")
        console.print(waiting)
    events = Table(title=f"last {len(status['events'])} events")
    for column in ("time", "node", "kind", "detail"):
        events.add_column(column)
    for e in status["events"]:
        events.add_row(_when(e.get("time")), str(e.get("node")), str(e.get("kind")),
                       _event_text(e))
    console.print(events)


def render_runs(console, runs: list[dict]) -> None:
    from rich.table import Table

    table = Table(title=f"runs under {p.SCHEMA_PREFIX}/")
    for column in ("run id", "round", "state", "world size", "live nodes"):
        table.add_column(column)
    for run in runs:
        table.add_row(run["run_id"], str(run["round"]), str(run["state"]),
                      str(run["world_size"]), str(run["nodes"]))
    console.print(table if runs else "no runs in etcd")


# ---- the command ----------------------------------------------------------------
def show(client, console, args) -> None:
    if args.run_id:
        view = run_status(client, args.run_id, args.events)
        if args.json:
            print(json.dumps(view, default=str), file=console.file, flush=True)
        else:
            render_status(console, view)
    else:
        runs = list_runs(client)
        if args.json:
            print(json.dumps({"runs": runs}), file=console.file, flush=True)
        else:
            render_runs(console, runs)


def watch(client, console, args) -> int:
    """Render, then render again after each batch of changes; Ctrl-C ends it with 0."""
    changes: queue.Queue = queue.Queue()
    prefix = run_prefix(args.run_id) if args.run_id else f"{p.SCHEMA_PREFIX}/"
    _, revision = client.get_prefix(prefix + "\0")  # just the store revision
    # A compaction the watch resumed past hid changes: draw again, from a new read.
    handle = client.watch_prefix(prefix, revision + 1, lambda evs: changes.put(
        [e for e in evs if not is_store_key(e.key)]), on_compacted=lambda _: changes.put([True]))
    try:
        while True:
            if console.is_terminal and not args.json:
                console.clear()
            elif not args.json:
                console.rule(time.strftime("%H:%M:%S"))
            show(client, console, args)
            console.file.flush()
            while not _drain(changes):
                pass
    except KeyboardInterrupt:
        return 0
    finally:
        handle.cancel()


def is_store_key(key: str) -> bool:
    """torch's store traffic (`rounds/<n>/store/`), judged below the run prefix: a run
    id "store" is valid, and its every key held "/store/"."""
    split = p.split_run_key(key)
    if split is None or p.round_of(split[1]) is None:
        return False
    return split[1].split("/")[2] == "store"


def _drain(changes: queue.Queue) -> bool:
    """Wait for a relevant change, then swallow the burst that came with it."""
    try:
        relevant = bool(changes.get(timeout=1.0))
    except queue.Empty:
        return False
    while True:
        try:
            relevant |= bool(changes.get_nowait())
        except queue.Empty:
            return relevant


def main(argv: list[str], environ: dict[str, str]) -> int:
    from rich.console import Console

    from elastic_runner.agent.launch import connect

    parser = build_parser()
    apply_env_defaults(parser, environ, STATUS_FLAGS)
    args = parse_checked(parser, argv)
    client = connect(etcd_config(args, environ))
    console = Console(soft_wrap=args.json, highlight=not args.json)
    try:
        if args.watch:
            return watch(client, console, args)
        show(client, console, args)
        return 0
    finally:
        client.close()
