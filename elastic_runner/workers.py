"""Starting, watching and stopping one node's worker processes.

Workers get torchrun's environment so unmodified torchrun scripts run. Each is a
session leader (so a stop reaches its children too) with a parent-death signal
(so an agent killed by SIGKILL does not leave workers training on in a job that
has already re-formed without them).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from elastic_runner._process import die_with_parent
from elastic_runner.config import WorkerConfig
from elastic_runner.rendezvous.protocol import Plan, RankAssignment, assign_ranks

STDERR_TAIL_LINES = 20
# A worker that checkpointed for a spot notice exits with this (EX_TEMPFAIL):
# membership is changing, nothing failed. Mirrors runtime.EXIT_FOR_RESIZE.
EXIT_FOR_RESIZE = 75


def worker_env(base: dict[str, str], plan: Plan, ranks: RankAssignment, run_id: str,
               max_restarts: int, config: WorkerConfig) -> dict[str, str]:
    env = dict(base)
    env.update(config.extra_env)
    env.update({
        "RANK": str(ranks.rank), "LOCAL_RANK": str(ranks.local_rank),
        "WORLD_SIZE": str(ranks.world_size), "LOCAL_WORLD_SIZE": str(ranks.local_world_size),
        "GROUP_RANK": str(ranks.group_rank), "GROUP_WORLD_SIZE": str(ranks.group_world_size),
        "ROLE_RANK": str(ranks.rank), "ROLE_WORLD_SIZE": str(ranks.world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": plan.master_addr, "MASTER_PORT": str(plan.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(plan.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "ELASTIC_RUN_ROUND": str(plan.round),
        "PYTHONUNBUFFERED": "1",
    })
    if ranks.local_world_size > 1 and "OMP_NUM_THREADS" not in base:
        # Several workers on one node each spawning a thread per core oversubscribe
        # it (measured: 4.6x slower steps with 2 workers on 2 cores); torchrun
        # makes the same choice. An explicit OMP_NUM_THREADS wins.
        env["OMP_NUM_THREADS"] = "1"
    if config.gpu_count > 0:
        visible = base.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(config.gpu_count)]
        env["CUDA_VISIBLE_DEVICES"] = devices[ranks.local_rank % len(devices)]
    return env


@dataclass
class WorkerExit:
    rank: int
    local_rank: int
    exit_code: int
    at: float
    stderr_tail: list[str]
    log_file: str | None
    stalled_s: float | None = None  # set when it hung instead of exiting

    @property
    def signal_name(self) -> str | None:
        if self.exit_code < 0:
            try:
                return signal.Signals(-self.exit_code).name
            except ValueError:
                return f"signal {-self.exit_code}"
        return None

    def as_failure(self, node_id: str) -> dict:
        return {"node_id": node_id, "rank": self.rank, "local_rank": self.local_rank,
                "exit_code": self.exit_code, "signal": self.signal_name,
                "stderr_tail": self.stderr_tail, "log_file": self.log_file,
                "stalled_s": self.stalled_s}


class _Worker:
    def __init__(self, ranks: RankAssignment, process: subprocess.Popen,
                 log_path: Path | None, echo: bool):
        self.ranks = ranks
        self.process = process
        self.log_path = log_path
        self.tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.exit: WorkerExit | None = None
        log_file = open(log_path, "a", buffering=1) if log_path else None
        self._pumps = [
            threading.Thread(target=self._pump, args=(process.stdout, sys.stdout, None, log_file,
                                                      echo), daemon=True),
            threading.Thread(target=self._pump, args=(process.stderr, sys.stderr, self.tail,
                                                      log_file, echo), daemon=True),
        ]
        for pump in self._pumps:
            pump.start()

    def _pump(self, source, sink, tail, log_file, echo) -> None:
        prefix = f"[rank{self.ranks.rank}]: "
        for raw in iter(source.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if tail is not None:
                tail.append(line)
            if log_file:
                log_file.write(line + "\n")
            if echo:
                sink.write(prefix + line + "\n")
                sink.flush()
        source.close()

    def poll(self) -> WorkerExit | None:
        if self.exit is None and self.process.poll() is not None:
            for pump in self._pumps:
                pump.join(timeout=1.0)  # let the last stderr lines arrive
            self.exit = WorkerExit(self.ranks.rank, self.ranks.local_rank,
                                   self.process.returncode, time.monotonic(), list(self.tail),
                                   str(self.log_path) if self.log_path else None)
        return self.exit


class WorkerGroup:
    """The nproc workers of one node for one round."""

    def __init__(self, workers: list[_Worker]):
        self._workers = workers

    @staticmethod
    def start(plan: Plan, node_id: str, run_id: str, max_restarts: int,
              config: WorkerConfig, base_env: dict[str, str], echo: bool = True) -> "WorkerGroup":
        workers = []
        for ranks in assign_ranks(plan, node_id):
            log_path = None
            if config.log_dir:
                folder = config.log_dir / run_id / f"round{plan.round}"
                folder.mkdir(parents=True, exist_ok=True)
                log_path = folder / f"rank{ranks.rank}.log"
            process = subprocess.Popen(
                list(config.argv), env=worker_env(base_env, plan, ranks, run_id,
                                                  max_restarts, config),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=die_with_parent,
            )
            workers.append(_Worker(ranks, process, log_path, echo))
        return WorkerGroup(workers)

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def poll(self) -> list[WorkerExit | None]:
        return [w.poll() for w in self._workers]

    def first_failure(self) -> WorkerExit | None:
        failed = [e for e in self.poll()
                  if e is not None and e.exit_code not in (0, EXIT_FOR_RESIZE)]
        return min(failed, key=lambda e: e.at) if failed else None

    def stalled(self, progress_dir: Path, timeout_s: float) -> WorkerExit | None:
        """A running worker whose er.report() progress is older than timeout_s.

        Only workers that reported at least once are judged, so start-up (import
        torch, process group) never counts; a deadlocked collective does.
        """
        now = time.time()
        for worker in self._workers:
            if worker.process.poll() is not None:
                continue
            try:
                age = now - (progress_dir / f"rank{worker.ranks.rank}.json").stat().st_mtime
            except FileNotFoundError:
                continue
            if age > timeout_s:
                return WorkerExit(worker.ranks.rank, worker.ranks.local_rank, -signal.SIGKILL,
                                  time.monotonic(), list(worker.tail),
                                  str(worker.log_path) if worker.log_path else None,
                                  stalled_s=round(age, 1))
        return None

    def stopped_for_resize(self) -> bool:
        return any(e is not None and e.exit_code == EXIT_FOR_RESIZE for e in self.poll())

    def all_succeeded(self) -> bool:
        return all(e is not None and e.exit_code == 0 for e in self.poll())

    def signal_all(self, signum: int) -> None:
        for worker in self._workers:
            if worker.process.poll() is None:
                try:
                    os.killpg(worker.process.pid, signum)
                except ProcessLookupError:
                    pass

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(e is not None for e in self.poll()):
                return True
            time.sleep(0.02)
        return all(e is not None for e in self.poll())

    def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL whatever is left after the grace period."""
        self.signal_all(signal.SIGTERM)
        if not self.wait(grace_s):
            self.signal_all(signal.SIGKILL)
            self.wait(10.0)
