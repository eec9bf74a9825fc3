"""Shared pieces: launching both launchers' agents, reading step logs, killing by PID.

Every process a benchmark starts is a session leader (start_new_session=True) and
is remembered here; `cleanup()` (also at exit and on SIGINT/SIGTERM) kills each
one's process group and every descendant found through /proc, by PID only.
"""

from __future__ import annotations

import atexit
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from elastic_runner._process import process_tree, signal_machine, stat_fields
from elastic_runner.events import read_jsonl

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORKLOAD = BENCH / "workload.py"
PY = sys.executable
RESULTS = BENCH / "results"
LATEST = BENCH / "latest"

_started: list[subprocess.Popen] = []


# ---- processes -------------------------------------------------------------------
def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """The whole node dies: the agent, its process group and every descendant
    (torchrun puts each worker in its own session, so the group alone is not enough)."""
    signal_machine(pid, sig)
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def spawn(argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "ab") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env=env, cwd=str(ROOT))
    _started.append(proc)
    return proc


def cleanup() -> None:
    for proc in _started:
        kill_tree(proc.pid)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    _started.clear()


atexit.register(cleanup)


def _on_signal(signum, frame):
    cleanup()
    sys.exit(128 + signum)


signal.signal(signal.SIGTERM, _on_signal)
signal.signal(signal.SIGINT, _on_signal)


def children_of(pid: int) -> list[int]:
    """The live processes whose parent is `pid`."""
    return [child for child in process_tree(pid)[1:]
            if (fields := stat_fields(child)) is not None and int(fields[1]) == pid]


def listener_pid(port: int) -> int | None:
    """PID listening on 127.0.0.1:port (which torchrun agent hosts the c10d store)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A" and int(parts[1].split(":")[1], 16) == port:
                inodes.add(parts[9])
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                link = os.readlink(f"/proc/{entry}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(entry)
        except OSError:
            continue
    return None


# ---- logs ------------------------------------------------------------------------
def steps_of(path: Path) -> list[dict]:
    return sorted((r for r in read_jsonl(path) if r.get("kind") == "step"), key=lambda r: r["t"])


def free_port() -> int:
    from elastic_runner.etcd.server import free_port as fp
    return fp()


# ---- launchers -------------------------------------------------------------------
@dataclass
class Launcher:
    """One job: agents of one launcher, all running bench/workload.py."""

    kind: str                      # "elastic-run" | "torchrun" | "torchrun-etcd-v2"
    workdir: Path
    min_nodes: int = 1
    max_nodes: int = 3
    nproc: int = 1
    script_args: tuple = ()
    env_extra: dict = field(default_factory=dict)
    endpoint: str = ""             # etcd for elastic-run
    lease_ttl: int = 2
    settle: float = 1.0
    script: Path = WORKLOAD
    label: str = ""
    agents: dict = field(default_factory=dict)
    started_at: dict = field(default_factory=dict)
    run_id: str = ""
    port: int = 0

    def __post_init__(self):
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.run_id = self.run_id or f"bench-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
        # Variant keys such as "er+ckpt" end up in run ids, which allow [A-Za-z0-9._-] only.
        self.run_id = self.run_id.replace("+", "-")
        self.port = self.port or free_port()
        (self.workdir / "ckpt").mkdir(exist_ok=True)

    @property
    def steps_file(self) -> Path:
        return self.workdir / "steps.jsonl"

    def argv(self, node: str) -> list[str]:
        tail = [str(self.script), "--out", str(self.steps_file),
                "--ckpt-dir", str(self.workdir / "ckpt"), *map(str, self.script_args)]
        if self.kind == "elastic-run":
            return [PY, "-m", "elastic_runner", "--rdzv-endpoints", self.endpoint,
                    "--run-id", self.run_id, "--node-id", node,
                    "--min-nodes", str(self.min_nodes), "--max-nodes", str(self.max_nodes),
                    "--nproc-per-node", str(self.nproc), "--lease-ttl", str(self.lease_ttl),
                    "--settle", str(self.settle), "--stop-grace", "2", "--max-restarts", "10",
                    *tail]
        backend, endpoint = ("c10d", f"127.0.0.1:{self.port}") if self.kind == "torchrun" \
            else ("etcd-v2", self.endpoint.split("://")[-1])
        return [PY, "-m", "torch.distributed.run", "--nnodes",
                f"{self.min_nodes}:{self.max_nodes}", "--nproc-per-node", str(self.nproc),
                "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
                "--rdzv-id", self.run_id, "--max-restarts", "10", *tail]

    def start(self, *nodes: str) -> float:
        env = dict(os.environ, **self.env_extra)
        env.pop("TORCHELASTIC_RESTART_COUNT", None)
        t = time.time()
        for node in nodes:
            self.agents[node] = spawn(self.argv(node), self.workdir / f"agent-{node}.log", env)
            self.started_at[node] = t
        return t

    def alive(self) -> list[str]:
        return [n for n, p in self.agents.items() if p.poll() is None]

    def sigkill(self, node: str) -> float:
        t = time.time()
        kill_tree(self.agents[node].pid)
        self.agents[node].wait(timeout=10)
        return t

    def freeze(self, node: str) -> float:
        """The machine freezes: agent and workers stop, their sockets stay open."""
        t = time.time()
        kill_tree(self.agents[node].pid, signal.SIGSTOP)
        return t

    def sigkill_worker(self, node: str) -> float:
        """One worker process of the node alone, as the OOM killer ends one: what it
        forked (a DataLoader's worker processes) lives on."""
        agent = self.agents[node].pid
        workers = [pid for pid in children_of(agent)
                   if b"workload.py" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        t = time.time()
        os.kill(workers[0], signal.SIGKILL)
        return t

    def sigterm(self, node: str) -> float:
        t = time.time()
        self.agents[node].send_signal(signal.SIGTERM)
        return t

    def host_node(self) -> str | None:
        """torchrun: the agent that listens on the c10d store port. elastic-run: the
        node whose worker is rank 0 (it hosts MASTER_ADDR's store this round)."""
        if self.kind == "torchrun":
            pid = listener_pid(self.port)
            for node, proc in self.agents.items():
                if proc.pid == pid:
                    return node
            return None
        rows = [r for r in steps_of(self.steps_file) if r["rank"] == 0]
        if not rows:
            return None
        ppid = rows[-1]["ppid"]
        for node, proc in self.agents.items():
            if proc.pid == ppid and proc.poll() is None:
                return node
        return None

    def stop_all(self) -> None:
        for proc in self.agents.values():
            kill_tree(proc.pid)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def tail(self, node: str, n: int = 1500) -> str:
        try:
            return (self.workdir / f"agent-{node}.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""


def first_full_step(path: Path, world: int, after: float, ranks_needed: int | None = None,
                    old: frozenset = frozenset()):
    """Earliest step row at `world` after `after` such that every rank of that world
    has logged at least one step since `after` (a world that actually trains); rows of
    the incarnations in `old` do not count."""
    rows = first_full_step_rows(path, world, after, ranks_needed, old)
    return min(rows, key=lambda r: r["t"]) if rows else None


def incarnation(row: dict) -> tuple:
    """Which start of a worker a step row comes from: its process, and in it the round
    (elastic-run in place keeps the process). The restart count alone is not enough:
    torchrun's agent counts only its own workers' failures, so a survivor's restarted
    worker reports the same count as the one before it."""
    return row.get("pid"), row.get("restart"), row.get("round")


def first_full_step_rows(path: Path, world: int, after: float,
                         ranks_needed: int | None = None,
                         old: frozenset = frozenset()) -> list[dict]:
    """Each rank's first step row at `world` after `after`, once all ranks have one."""
    seen: dict[int, dict] = {}
    for r in steps_of(path):
        if r["world"] == world and r["t"] >= after and incarnation(r) not in old:
            seen.setdefault(r["rank"], r)
            if len(seen) >= (ranks_needed or world):
                return list(seen.values())
    return []


def wait_until(pred, timeout: float, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    return None


def check_etcd_binary(parser, binary: str | None) -> None:
    """A --etcd-binary that is not there ends the run at once, in one line: a soak or a
    scale run found it only after its set-up, with a traceback. Debian's package puts
    etcd in /usr/bin; scripts/debian_etcd.sh unpacks it into .venv/debian-etcd/usr/bin."""
    from elastic_runner.errors import EtcdBinaryNotFound
    from elastic_runner.etcd.server import find_etcd_binary

    try:
        find_etcd_binary(binary)
    except EtcdBinaryNotFound as error:
        parser.error(str(error))


# ---- output ----------------------------------------------------------------------
def etcd_version(binary: str | None = None) -> str:
    """The version the etcd server `binary` (default: the one the agents find) reports."""
    try:
        from elastic_runner.etcd.server import find_etcd_binary
        out = subprocess.run([find_etcd_binary(binary), "--version"], capture_output=True,
                             text=True, timeout=10).stdout.split("\n")[0]
        return out.replace("etcd Version: ", "")
    except Exception as exc:  # noqa: BLE001
        return f"unknown ({exc})"


def env_info() -> dict:
    import torch
    info = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}
    info["etcd"] = etcd_version()
    try:
        info["loadavg_at_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def result_text(payload: dict) -> str:
    """A result as JSON, with paths inside the repository (a trace, a script, --out)
    relative to it: published results must not name the machine they came from."""
    return json.dumps(payload, indent=2, default=str).replace(f"{ROOT}/", "")


def save(name: str, payload: dict, table: str) -> Path:
    RESULTS.mkdir(exist_ok=True)
    LATEST.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    payload = {**payload, "table": table}
    path = RESULTS / f"{name}-{stamp}.json"
    text = result_text(payload)
    path.write_text(text)
    (LATEST / f"{name}.json").write_text(text)
    return path


def mmm(values):
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals), "n": len(vals)}


def fmt(stat, unit="s", digits=1):
    if stat is None:
        return "n/a"
    if isinstance(stat, (int, float)):
        return f"{stat:.{digits}f}{unit}"
    if stat["n"] == 1:
        return f"{stat['median']:.{digits}f}{unit}"
    return f"{stat['median']:.{digits}f}{unit} [{stat['min']:.{digits}f}-{stat['max']:.{digits}f}]"


def ratio(a, b):
    if a is None or b is None:
        return None
    a = a["median"] if isinstance(a, dict) else a
    b = b["median"] if isinstance(b, dict) else b
    return a / b if b else None


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
