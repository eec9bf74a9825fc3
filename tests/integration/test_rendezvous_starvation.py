"""256 agents whose processes are frozen past their lease TTL still end up in one plan.

Why: on a busy host an agent can be starved of CPU for longer than --lease-ttl;
etcd then drops its lease and node key while the agent, once it runs again,
still believes it is a member (issue #17, item 5). The engine must let it
register again under a new lease and join the open round, and the agents
that kept running must re-form without it and then with it, so the job ends up
whole rather than split or stuck.

The agents run in four child processes (tests/helpers/rdzv_crowd.py); SIGSTOP
freezes a whole process, which is what a starved host looks like from etcd.
The test asserts outcomes only (one plan, its members, new leases, no errors),
never how long anything took: a slow machine makes it slower, not wrong.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from elastic_runner.config import EtcdConfig
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.rendezvous import protocol as p

NODES = 256
PROCESSES = 4
LEASE_TTL_S = 3
# Longer than the TTL plus etcd's expiry slack: every frozen agent loses its lease.
FROZEN_S = 5.0
# Each burst freezes two processes, the second a second after the first, so
# leases expire at different moments and rounds are in flight when they do.
BURSTS = ((0, 1), (2, 3), (1, 2))
STAGGER_S = 1.0
BETWEEN_BURSTS_S = 2.0
AGREEMENT_DEADLINE_S = 180.0
RUN_ID = "starved"
REPO = Path(__file__).resolve().parents[2]


def read_reports(out: Path) -> dict[str, list[dict]]:
    """Every agent's reports in the order it wrote them; a line cut by a kill is skipped."""
    reports: dict[str, list[dict]] = {}
    for path in sorted(out.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            reports.setdefault(record["node"], []).append(record)
    return reports


class Crowd:
    """The four child processes, and what etcd and their reports say about them."""

    def __init__(self, endpoint: str, out: Path):
        self.out = out
        self.client = EtcdClient(EtcdConfig.build((endpoint,), timeout_s=30.0))
        self.endpoint = endpoint
        self.prefix = p.run_prefix(RUN_ID)
        self.children: list[subprocess.Popen] = []

    def start(self) -> None:
        share = NODES // PROCESSES
        for index in range(PROCESSES):
            self.children.append(self._spawn(index, index * share, share))

    def _spawn(self, index: int, first: int, count: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "tests.helpers.rdzv_crowd", "--endpoint", self.endpoint,
                   "--run-id", RUN_ID, "--index", str(index), "--first", str(first),
                   "--count", str(count), "--max-nodes", str(NODES),
                   "--lease-ttl", str(LEASE_TTL_S), "--out", str(self.out)]
        with open(self.out / f"{index}.log", "wb") as log:
            return subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def send(self, index: int, signum: int) -> None:
        if self.children[index].poll() is None:
            self.children[index].send_signal(signum)

    def etcd_view(self) -> tuple[p.RoundState | None, dict[str, int]]:
        """The round as etcd holds it, and each registered node's current lease."""
        kv = self.client.get(p.round_key(self.prefix))
        kvs, _ = self.client.get_prefix(p.nodes_prefix(self.prefix))
        return (p.RoundState.from_json(kv.value) if kv else None,
                {p.node_id_from_key(kv.key): kv.lease for kv in kvs})

    def agreed_round(self, after_round: int) -> int | None:
        """The round every agent holds, once all hold one plan of NODES members that
        etcd confirms: that round is closed and is the newest, and each agent got
        it under the lease etcd now holds its node key with (not a plan from
        before its lease expired, which a frozen process cannot have replaced yet)."""
        reports = read_reports(self.out)
        newest = [next((r for r in reversed(lines) if "round" in r), None)
                  for lines in reports.values()]
        if len(newest) < NODES or None in newest or \
                len({(r["round"], r["digest"], r["members"]) for r in newest}) != 1:
            return None
        number = newest[0]["round"]
        if number <= after_round or newest[0]["members"] != NODES:
            return None
        state, leases = self.etcd_view()
        if state is None or (state.number, state.state) != (number, p.CLOSED):
            return None
        return number if all(leases.get(r["node"]) == r["lease"] for r in newest) else None

    def wait_for_agreement(self, after_round: int, what: str) -> int:
        deadline = time.monotonic() + AGREEMENT_DEADLINE_S
        while time.monotonic() < deadline:
            errors = self.errors()
            if errors:
                pytest.fail(self.describe(f"agents failed before {what}"))
            number = self.agreed_round(after_round)
            if number is not None:
                return number
            time.sleep(0.5)
        pytest.fail(self.describe(f"no agreement of {NODES} agents within "
                                  f"{AGREEMENT_DEADLINE_S:g} s {what}"))

    def errors(self) -> list[dict]:
        return [r for lines in read_reports(self.out).values() for r in lines if "error" in r]

    def describe(self, headline: str) -> str:
        """Where every agent is, for the engine's author: rounds, errors, leases, stacks."""
        for index in range(len(self.children)):
            if (self.out / f"{index}.jsonl").exists():  # else SIGUSR1 would kill it
                self.send(index, signal.SIGUSR1)
        time.sleep(2.0)  # the children write their stacks
        reports = read_reports(self.out)
        newest = {node: next((r for r in reversed(lines) if "round" in r), None)
                  for node, lines in reports.items()}
        by_round = Counter((r["round"], r["members"], r["digest"]) if r else None
                           for r in newest.values())
        state, leases = self.etcd_view()
        stale = sorted(node for node, r in newest.items() if r and leases.get(node) != r["lease"])
        errors = self.errors()
        exits = [child.poll() for child in self.children]
        return "\n".join([
            headline,
            f"agents that reported: {len(reports)} of {NODES}; "
            f"exit codes of the children (None: running): {exits}",
            "newest plan per agent, (round, members, digest): count: "
            + ", ".join(f"{key}: {count}" for key, count in sorted(by_round.items(), key=str)),
            f"etcd: round {state}, {len(leases)} node keys",
            f"agents whose newest plan is not under their lease in etcd: {len(stale)} "
            f"{stale[:12]}",
            f"errors: {len(errors)}, by kind and where raised (innermost last): "
            + "; ".join(f"{count} x {kind}" for kind, count in Counter(
                (e["error"][:160], " > ".join(e.get("where", []))) for e in errors).items()),
            f"logs and stacks: {self.out}/<index>.log, {self.out}/<index>.stacks"])

    def stop(self) -> None:
        """SIGCONT first (a frozen process cannot act on SIGTERM), then SIGKILL the slow."""
        for index in range(len(self.children)):
            self.send(index, signal.SIGCONT)
            self.send(index, signal.SIGTERM)
        for child in self.children:
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self.client.close()


def starve(crowd: Crowd) -> None:
    """Freeze two processes at a time past the TTL, staggered, a few times over."""
    for first, second in BURSTS:
        crowd.send(first, signal.SIGSTOP)
        time.sleep(STAGGER_S)
        crowd.send(second, signal.SIGSTOP)
        time.sleep(FROZEN_S - STAGGER_S)
        crowd.send(first, signal.SIGCONT)
        time.sleep(STAGGER_S)
        crowd.send(second, signal.SIGCONT)
        time.sleep(BETWEEN_BURSTS_S)


def re_registered(out: Path) -> list[str]:
    """Agents that reported a plan under a lease other than their first one."""
    found = []
    for node, lines in read_reports(out).items():
        leases = [r["lease"] for r in lines if "lease" in r]
        if leases and any(lease != leases[0] for lease in leases):
            found.append(node)
    return found


@pytest.mark.timeout(3 * AGREEMENT_DEADLINE_S)
def test_agents_frozen_past_their_lease_rejoin_one_plan_of_all(etcd, tmp_path):
    """The slow one of the integration tests: 256 agents, ~35 s on two idle cores."""
    crowd = Crowd(etcd.endpoint, tmp_path)
    try:
        crowd.start()
        started = time.monotonic()
        first = crowd.wait_for_agreement(-1, "at the start")
        agreed_at = time.monotonic()
        starve(crowd)
        starved_at = time.monotonic()
        last = crowd.wait_for_agreement(first, "after the freezes")
        print(f"\nround {first} agreed after {agreed_at - started:.1f} s; "
              f"{len(BURSTS)} freezes took {starved_at - agreed_at:.1f} s; round {last} "
              f"agreed {time.monotonic() - starved_at:.1f} s later; "
              f"{len(re_registered(tmp_path))} agents re-registered")
        assert re_registered(tmp_path), crowd.describe(
            "no agent reported a plan under a new lease: the freezes expired no lease")
        assert not crowd.errors(), crowd.describe("agents failed")
    finally:
        crowd.stop()
