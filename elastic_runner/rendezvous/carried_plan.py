"""The plan a closed round's key carries: as a change to the previous plan when it can.

Why: every agent watches the round key, so whatever it holds is sent N times per
round. Carrying the whole plan made each round cost etcd N x N bytes (8.4 MB at
1,024 nodes; 0.35 GB at 4,096, 5.6 GB at 16,384 with distinct addresses). A resize
changes a few members, and every member of the previous round holds that round's
plan (written once, never changed), so the round key carries the edit: runs of
the previous plan's members kept in order, and the records of the others. Its
size follows the change, not N.

Exact by construction: a member is taken from the previous plan only when its
record there is identical (id, nproc, addr, labels); everything else is written
out, and the result goes through the same checks as a plan read from etcd
(Plan.from_dict). An agent without the previous plan (a newcomer, one that missed
a round) reads the whole plan from its key, as before.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

from elastic_runner.rendezvous.protocol import Member, Plan, RoundState

log = logging.getLogger(__name__)

# A delta longer than this share of the whole plan is not worth its rebuild.
MAX_DELTA_SHARE = 0.5


def round_value(state: RoundState, plan: Plan | None, previous: Plan | None) -> bytes:
    """The round key's value: the state, and for a closed round its plan, as the
    edit of `previous` when that is much shorter than the plan."""
    data = asdict(state)
    if plan is not None:
        edit = delta(previous, plan) if previous is not None else None
        if edit is not None and len(edit["runs"]) <= MAX_DELTA_SHARE * len(plan.members):
            data["plan_delta"] = edit
        else:
            data["plan"] = plan.to_dict()
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def delta(previous: Plan, plan: Plan) -> dict:
    """`plan` as runs [start, stop) of `previous`'s members and literal records."""
    position = {m.node_id: i for i, m in enumerate(previous.members)}
    runs: list = []
    for member in plan.members:
        index = position.get(member.node_id)
        if index is not None and _same_record(previous.members[index], member):
            last = runs[-1] if runs else None
            if isinstance(last, list) and last[1] == index:
                last[1] = index + 1
            else:
                runs.append([index, index + 1])
        else:
            runs.append({"id": member.node_id, "nproc": member.nproc, "addr": member.addr,
                         "labels": dict(member.labels)})
    data = {f: getattr(plan, f) for f in Plan._SCALARS}
    data.update(of_round=previous.round, n=len(plan.members), world_size=plan.world_size,
                runs=runs)
    return data


def _same_record(a: Member, b: Member) -> bool:
    return (a.nproc, a.addr, a.labels) == (b.nproc, b.addr, b.labels)


def carried(raw: bytes, held: dict[int, Plan]) -> Plan | None:
    """The plan a round key's value carries; None for an open round, for an edit of a
    plan not in `held` (round -> plan), or for one that does not apply: the caller
    then reads the whole plan, which is the record."""
    data = json.loads(raw)
    edit = data.get("plan_delta")
    base = held.get(edit.get("of_round")) if isinstance(edit, dict) else None
    try:
        if "plan" in data:
            return Plan.from_dict(data["plan"])
        return apply(base, edit) if base is not None else None
    except ValueError as e:
        log.warning("the round key's plan does not read (%s); reading the plan itself", e)
        return None


def apply(previous: Plan, edit: dict) -> Plan:
    """Rebuild the plan from `previous` and an edit; checked like any plan record.

    Raises:
        ValueError: the edit does not describe a sound plan over `previous`.
    """
    ids, nprocs, addrs, labels = [], [], [], []
    try:
        for run in edit["runs"]:
            if isinstance(run, list):
                start, stop = run
                if not 0 <= start < stop <= len(previous.members):
                    raise ValueError(f"run {run} outside round {previous.round}'s plan")
                kept = previous.columns
                ids += kept.ids[start:stop]
                nprocs += kept.nprocs[start:stop]
                addrs += kept.addrs[start:stop]
                labels += map(dict, kept.labels[start:stop])
            else:
                ids.append(run["id"])
                nprocs.append(run["nproc"])
                addrs.append(run["addr"])
                labels.append(run.get("labels", {}))
        data = {f: edit[f] for f in Plan._SCALARS}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed plan edit: {e!r}") from e
    if len(ids) != edit.get("n"):
        raise ValueError(f"malformed plan edit: {len(ids)} members, the edit says {edit.get('n')}")
    data.update(format=2, ids=ids, nproc=nprocs, addrs=addrs,
                world_size=edit.get("world_size"))
    if any(labels):
        data["labels"] = labels
    return Plan.from_dict(data)
