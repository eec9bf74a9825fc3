"""Starting, watching and stopping one node's worker processes.

Workers get torchrun's environment so unmodified torchrun scripts run. Each is a
session leader (so a stop reaches its children too) with a parent-death signal
(so an agent killed by SIGKILL does not leave workers training on in a job that
has already re-formed without them).
"""

from __future__ import annotations

import collections
import fcntl
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from elastic_runner._process import bound_to_parent
from elastic_runner.agent.prewarm import WarmPool
from elastic_runner.config import AgentConfig, EtcdConfig, WorkerConfig
from elastic_runner.contract import (
    AGENT_ONLY_VARIABLES, EXIT_FOR_RESIZE, NOTICE_FILE, PASSWORD_FILE, PLACEMENT_FIELDS,
    PROGRESS_DIR, STACKS_SIGNAL, WorkerEnv, error_file, variable,
)
from elastic_runner.reform import REFORM_DIR, STANDBY_ROUND
from elastic_runner.rendezvous.protocol import Plan
from elastic_runner.rendezvous.ranks import RankAssignment, assign_ranks

log = logging.getLogger("elastic_runner")

STDERR_TAIL_LINES = 20
# A dead worker's pipes that held no unread byte this long: what it wrote has arrived.
OUTPUT_QUIET_S = 0.05
# At most this long for a dead worker's last lines (its pipes' end, or their quiet).
OUTPUT_WAIT_S = 1.0
NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def worker_env(base: dict[str, str], plan: Plan, ranks: RankAssignment, job: WorkerEnv,
               config: WorkerConfig, error_dir: Path | None = None) -> dict[str, str]:
    """The agent's environment, less its secrets, plus this worker's WorkerEnv.

    `job` carries what every worker of the node shares (run id, etcd, scratch paths);
    the plan and `ranks` fill in the rest.
    """
    this = replace(
        job, rank=ranks.rank, local_rank=ranks.local_rank, world_size=ranks.world_size,
        local_world_size=ranks.local_world_size, group_rank=ranks.group_rank,
        group_world_size=ranks.group_world_size, role_rank=ranks.rank,
        role_world_size=ranks.world_size, master_addr=plan.master_addr,
        master_port=plan.master_port, restart_count=plan.restart_count, round=plan.round,
        error_file=str(error_file(error_dir, ranks.rank)) if error_dir else "")
    return _process_env(base, this, config)


def standby_env(base: dict[str, str], local_rank: int, job: WorkerEnv, config: WorkerConfig,
                error_path: Path | None = None) -> dict[str, str]:
    """A standby worker's environment (agent/standby.py): everything but a place.

    No RANK, WORLD_SIZE or MASTER_*: the script runs up to its training function
    without a process group, and its place comes through the re-formation channel."""
    this = replace(job, local_rank=local_rank, local_world_size=config.nproc,
                   round=STANDBY_ROUND, standby=True,
                   error_file=str(error_path) if error_path else "")
    env = _process_env(base, this, config)
    for name in PLACEMENT_FIELDS:
        env.pop(variable(name), None)
    return env


def _process_env(base: dict[str, str], this: WorkerEnv, config: WorkerConfig) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in AGENT_ONLY_VARIABLES}
    env.update(config.extra_env)
    env.update(this.to_env())
    env["PYTHONUNBUFFERED"] = "1"
    # As torchrun (LocalElasticAgent._start_workers): with it, an NCCL collective that
    # can no longer complete (a peer died) makes the worker fail instead of hanging
    # forever, so its agent sees an exit and the job re-forms. An explicit value wins.
    env[NCCL_ASYNC_ERROR_HANDLING] = base.get(NCCL_ASYNC_ERROR_HANDLING, "1")
    if this.local_world_size > 1 and "OMP_NUM_THREADS" not in base:
        # Several workers on one node each spawning a thread per core oversubscribe
        # it (measured: 4.6x slower steps with 2 workers on 2 cores); torchrun
        # makes the same choice. An explicit OMP_NUM_THREADS wins.
        env["OMP_NUM_THREADS"] = "1"
    if config.gpu_count > 0:
        visible = base.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(config.gpu_count)]
        env["CUDA_VISIBLE_DEVICES"] = devices[this.local_rank % len(devices)]
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

    error: str | None = None  # from the worker's TORCHELASTIC_ERROR_FILE (torch's @record)
    frame: str | None = None

    def as_failure(self, node_id: str) -> dict:
        return {"node_id": node_id, "rank": self.rank, "local_rank": self.local_rank,
                "exit_code": self.exit_code, "signal": self.signal_name,
                "stderr_tail": self.stderr_tail, "log_file": self.log_file,
                "stalled_s": self.stalled_s, "error": self.error, "frame": self.frame}


def read_error_file(path: Path) -> tuple[str | None, str | None]:
    """(exception, failing frame) from the JSON torch's @record writes, or (None, None).

    The format is torch's ErrorHandler.record_exception: {"message": {"message":
    "Type: text", "extraInfo": {"py_callstack": traceback}}}; a worker may also write
    {"message": "text"}. The frame is the traceback's last `File ..., line N, in f`.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):
        return message.strip() or None, None
    if not isinstance(message, dict):
        return None, None
    text = str(message.get("message") or "").strip() or None
    stack = str((message.get("extraInfo") or {}).get("py_callstack") or "")
    frames = [line.strip() for line in stack.splitlines() if line.strip().startswith("File ")]
    return text, _short_frame(frames[-1]) if frames else None


def _short_frame(line: str) -> str:
    """'File "/a/b/train.py", line 42, in step' -> 'train.py:42 in step'."""
    try:
        where, number, function = line.split(", ", 2)
        name = where[len('File "'):-1].rsplit("/", 1)[-1]
        return f"{name}:{number.removeprefix('line ')} {function}"
    except ValueError:
        return line


class _Worker:
    def __init__(self, ranks: RankAssignment, process: subprocess.Popen,
                 log_path: Path | None, echo: bool, error_path: Path | None = None):
        self.ranks = ranks
        self.process = process
        self.log_path = log_path
        self.error_path = error_path
        self.tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.exit: WorkerExit | None = None
        self.exited_at: float | None = None
        log_file = self._open_log(log_path) if log_path else None
        self._pumps = [
            threading.Thread(target=self._pump, args=(process.stdout, sys.stdout, None, log_file,
                                                      echo), daemon=True),
            threading.Thread(target=self._pump, args=(process.stderr, sys.stderr, self.tail,
                                                      log_file, echo), daemon=True),
        ]
        for pump in self._pumps:
            pump.start()
        threading.Thread(target=self._stamp_exit, daemon=True).start()

    def _stamp_exit(self) -> None:
        """When this worker ended, to the millisecond, not when the agent next looked.

        Why: one worker's death breaks its peers' collectives, and they exit too, often
        within milliseconds (at once when a broken round is cut). The agent polls a few
        times a second and finds them all gone at one look; the error line must name
        the worker that ended first (`first_failure`), not the lowest local rank."""
        self.process.wait()
        self.exited_at = time.monotonic()

    def _open_log(self, path: Path):
        try:
            return open(path, "a", buffering=1)
        except OSError as exc:  # a full or read-only log folder must not stop a start
            log.warning("worker %s: its log %s cannot be opened (%s); its output goes on "
                        "without it", self.name, path, exc)
            return None

    def _pump(self, source, sink, tail, log_file, echo) -> None:
        """Drain one of the worker's pipes to its end, whatever becomes of where it goes.

        Why: a worker blocks at its next print once its pipe holds 64 KiB. A log on a
        full disk (ENOSPC) or the agent's own output closed (`elastic-run ... | head`)
        ended this thread with the exception, and the worker hung mid-training. Now a
        destination that fails is dropped with one warning and the pipe still drained."""
        outputs = {"log": log_file, "echo": sink if echo else None}
        for raw in iter(source.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if tail is not None:
                tail.append(line)
            for what, out in outputs.items():
                if out is None:
                    continue
                # prefixed with the rank of now: an in-process re-formation changes it
                text = line + "\n" if what == "log" else f"[{self.name}]: {line}\n"
                try:
                    out.write(text)
                    out.flush()
                except (OSError, ValueError) as exc:
                    outputs[what] = None
                    if what == "log":
                        with suppress(OSError):
                            out.close()
                    log.warning("worker %s: %s no longer written (%s); its output goes on "
                                "without it", self.name, f"its log {self.log_path}"
                                if what == "log" else "the agent's output", exc)
        source.close()

    def _await_last_output(self) -> None:
        """Until the pumps have read what the dead worker wrote: its pipes' end, or
        both pipes empty for OUTPUT_QUIET_S.

        Why not their end alone: a process the worker forked (a DataLoader's workers,
        which torch ends up to 5 s after their parent) holds the pipes open. Each
        pump's join then waited out its 1 s timeout: a worker SIGKILLed beside two
        loader processes was reported 2.1 s after its death, and its round began
        that much later."""
        deadline = time.monotonic() + OUTPUT_WAIT_S
        quiet_since = None
        while any(pump.is_alive() for pump in self._pumps) and time.monotonic() < deadline:
            if _unread_bytes(self.process.stdout) or _unread_bytes(self.process.stderr):
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= OUTPUT_QUIET_S:
                return
            time.sleep(0.005)

    @property
    def name(self) -> str:
        """How its output is prefixed: its rank, or its local rank while on standby."""
        rank = self.ranks.rank
        return f"rank{rank}" if rank >= 0 else f"standby{self.ranks.local_rank}"

    def poll(self) -> WorkerExit | None:
        if self.exit is None and self.process.poll() is not None:
            self._await_last_output()
            error, frame = (read_error_file(self.error_path)
                            if self.error_path and self.process.returncode not in
                            (0, EXIT_FOR_RESIZE) else (None, None))
            self.exit = WorkerExit(self.ranks.rank, self.ranks.local_rank,
                                   self.process.returncode, self.exited_at or time.monotonic(),
                                   list(self.tail),
                                   str(self.log_path) if self.log_path else None,
                                   error=error, frame=frame)
        return self.exit


def _unread_bytes(pipe) -> int:
    """Bytes waiting in a pipe's kernel buffer; 0 once its pump closed it."""
    try:
        return struct.unpack("i", fcntl.ioctl(pipe.fileno(), termios.FIONREAD, b"\0" * 4))[0]
    except (OSError, ValueError):
        return 0


class WorkerGroup:
    """The nproc workers of one node for one round."""

    def __init__(self, workers: list[_Worker]):
        self._workers = workers

    @staticmethod
    def start(plan: Plan | None, node_id: str, job: WorkerEnv, config: WorkerConfig,
              base_env: dict[str, str], echo: bool = True,
              error_dir: Path | None = None, prewarm: WarmPool | None = None) -> "WorkerGroup":
        """Start this node's workers of `plan`; `error_dir` gets torch's error files.
        No plan: `config.nproc` standby workers, named by local rank until placed.
        `prewarm`: take waiting interpreters where they fit (agent/prewarm.py)."""
        workers = []
        placements = (assign_ranks(plan, node_id) if plan is not None else
                      [RankAssignment(-1, local, 0, config.nproc, -1, 0)
                       for local in range(config.nproc)])
        for ranks in placements:
            name = f"rank{ranks.rank}" if plan is not None else f"standby{ranks.local_rank}"
            log_path = worker_log(config.log_dir, job.run_id, plan, node_id, name)
            error_path = error_dir / f"{name}.json" if error_dir else None
            if error_path is not None:
                error_path.unlink(missing_ok=True)  # an earlier round's error is not this one's
            env = (worker_env(base_env, plan, ranks, job, config, error_dir) if plan is not None
                   else standby_env(base_env, ranks.local_rank, job, config, error_path))
            process = prewarm.take(ranks.local_rank, env) if prewarm else None
            if process is None:
                process = subprocess.Popen(
                    bound_to_parent(config.argv), env=env, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
            workers.append(_Worker(ranks, process, log_path, echo, error_path))
        if prewarm and plan is not None:  # standby workers: the run re-forms in place
            prewarm.refill_later()
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

    def dump_stacks(self, local_ranks: Sequence[int], settle_s: float = 0.5) -> None:
        """Have these workers write every thread's Python stack to their logs, then
        give the output `settle_s` to arrive. Only for workers that ran er.init (it
        registers the handler; without one the signal would end the process)."""
        for local in local_ranks:
            process = self._workers[local].process
            if process.poll() is None:
                os.kill(process.pid, STACKS_SIGNAL)  # the worker alone: not its children
        time.sleep(settle_s)

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

    def reassign(self, plan: Plan, node_id: str) -> None:
        """The same processes now hold this node's ranks of `plan` (in-process re-formation).

        Why: failure messages, the stall check and the output prefix name a worker by
        its global rank, which a resize changes while the process lives on. A worker
        keeps its local rank; the log and error files it was started with stay its own.
        """
        ranks = assign_ranks(plan, node_id)
        if len(ranks) != len(self._workers):
            raise ValueError(f"round {plan.round} gives node {node_id} {len(ranks)} workers; "
                             f"{len(self._workers)} are running")
        for worker, assigned in zip(self._workers, ranks):
            worker.ranks = assigned

    def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL whatever is left after the grace period."""
        self.signal_all(signal.SIGTERM)
        if not self.wait(grace_s):
            self.signal_all(signal.SIGKILL)
            self.wait(10.0)


def worker_log(log_dir: Path | None, run_id: str, plan: Plan | None, node_id: str,
               name: str) -> Path | None:
    """`DIR/RUN/roundN/rankR.log`; a standby worker's under its node's name.

    Why the node: --log-dir is often one shared folder for every node, and standby
    workers have no global rank yet. Named by local rank alone, two nodes' standby
    workers appended to one file, which stays their log once they take a place."""
    if log_dir is None:
        return None
    folder = log_dir / run_id / (f"round{plan.round}" if plan is not None else
                                 f"standby/{node_id}")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}.log"


def job_env(config: AgentConfig, etcd: EtcdConfig, scratch: Path,
            events_path: Path | None, record_socket: Path | None = None) -> WorkerEnv:
    """What every worker of this node shares; the plan fills in ranks per round."""
    return WorkerEnv(
        run_id=config.rendezvous.run_id, max_restarts=config.max_restarts,
        signals_to_handle=config.signals_to_handle,
        etcd_endpoints=tuple(etcd.endpoints), etcd_prefix=config.rendezvous.prefix,
        etcd_cacert=etcd.cacert or "", etcd_cert=etcd.cert or "", etcd_key=etcd.key or "",
        etcd_user=etcd.user or "",
        etcd_password_file=str(scratch / PASSWORD_FILE) if etcd.password else "",
        notice_path=str(scratch / NOTICE_FILE),
        progress_dir=str(scratch / PROGRESS_DIR),
        events_path=str(events_path) if events_path is not None else "",
        reform_dir=str(scratch / REFORM_DIR),
        collective_timeout_s=config.rendezvous.collective_timeout_s,
        formation_timeout_s=config.rendezvous.formation_timeout_s, quick_exit=True,
        record_socket=str(record_socket) if record_socket else "")

