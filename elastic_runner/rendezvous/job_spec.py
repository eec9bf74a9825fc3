"""What every agent of one run must agree on (the run's `spec` key), and how two
specs differ. Pure, like protocol.py, which re-exports it.

The protocol number: the key prefix versions the schema (protocol.SCHEMA_PREFIX),
but an agent can also misread what a newer one writes under the same keys: an agent
of before 2026-12-07 would fail to parse the plans that a round's close now empties
two rounds back. The number is raised for such a change and is part of the spec, so
a node of another release is refused at join with one line instead of failing
mid-run. It is stored as a suffix of the fingerprint, which every older agent
already compares, so they refuse too ("different job ... fingerprint").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

# 1: every release before this field; 2: a round's close empties the plan two back;
# 3: a round's group keys live under default_pg/round-N in rank 0's store
# (worker/formation.py), so workers of protocol 2 and 3 could never form a group.
RUN_PROTOCOL = 3
_PROTOCOL_MARK = "+protocol-"


@dataclass(frozen=True)
class JobSpec:
    """What every agent of one run must agree on."""

    min_nodes: int
    max_nodes: int
    fingerprint: str
    # Bounds on the total number of workers (0: none). Nodes of one job may run
    # different numbers of workers (a 1-GPU and a 4-GPU spot instance), so the
    # per-node count is not part of the spec.
    min_workers: int = 0
    max_workers: int = 0
    # Stored as a suffix of the fingerprint, which every older agent compares: a node
    # of another elastic-runner protocol is refused at join with one line either way.
    protocol: int = RUN_PROTOCOL

    def to_json(self) -> bytes:
        fields = asdict(self)
        fields["fingerprint"] += f"{_PROTOCOL_MARK}{fields.pop('protocol')}"
        return json.dumps(fields, sort_keys=True).encode()

    @staticmethod
    def from_json(raw: bytes) -> "JobSpec":
        fields = json.loads(raw)
        script, _, protocol = fields["fingerprint"].partition(_PROTOCOL_MARK)
        return JobSpec(**{**fields, "fingerprint": script, "protocol": int(protocol or 1)})


def spec_conflict(existing: JobSpec, mine: JobSpec) -> str | None:
    """Describe how `mine` differs from the spec the run started with, or None."""
    diffs = [
        f"{name} {getattr(existing, name)!r} (run) vs {getattr(mine, name)!r} (this node)"
        for name in ("min_nodes", "max_nodes", "min_workers", "max_workers", "fingerprint")
        if getattr(existing, name) != getattr(mine, name)
    ]
    if existing.protocol != mine.protocol:
        diffs.append(f"elastic-runner protocol {existing.protocol} (run) vs {mine.protocol} "
                     "(this node): run one elastic-runner version on every node of a run")
    return "; ".join(diffs) or None
