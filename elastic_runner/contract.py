"""What the agent and its workers agree on, in one torch-free module both import.

The two sides talk through three media only, all spelled here:
- the environment the agent gives each worker (`WorkerEnv`: torchrun's variables,
  which unmodified torchrun scripts read, plus ELASTIC_RUN_* for the runtime);
- small files in the agent's private scratch folder (the notice marker, one progress
  file per rank -- written by `ProgressWriter`, read by `read_progress` -- the checkpoint
  record rank 0 leaves for the metrics, torch's error file per rank);
- exit codes (`EXIT_FOR_RESIZE`).
The etcd key layout is not part of it: it lives in `rendezvous/protocol.py`.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Mapping

from elastic_runner.files import write_atomic

# A worker that stopped on purpose for a resize (after checkpointing the current step)
# exits with EX_TEMPFAIL: membership is changing, nothing failed.
EXIT_FOR_RESIZE = 75

# torchrun's own default for TORCHELASTIC_SIGNALS_TO_HANDLE (torch.distributed.launcher.api
# sets it in the agent's environment, which workers inherit).
DEFAULT_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

# Sent by the agent to a worker it is about to stop for not pausing in time: er.init
# registers faulthandler for it, so the worker's log shows where each thread was held.
STACKS_SIGNAL = signal.SIGUSR2

# ---- files in the agent's scratch folder --------------------------------------------
NOTICE_FILE = "notice"  # appears when the job must stop at the next step boundary
PROGRESS_DIR = "progress"
CHECKPOINT_RECORD = "checkpoint.json"  # in PROGRESS_DIR, written by rank 0
ERROR_DIR = "errors"  # TORCHELASTIC_ERROR_FILE of each rank lives here
PASSWORD_FILE = "etcd-password"


def progress_file(progress_dir: Path, rank: int) -> Path:
    return progress_dir / f"rank{rank}.json"


def error_file(error_dir: Path, rank: int) -> Path:
    return error_dir / f"rank{rank}.json"


def read_progress(progress_dir: Path) -> list[dict]:
    """Every rank's last progress record ({step, samples, time, boundary, stopping,
    prev_step, prev_samples, prev_time}); unreadable files are skipped."""
    records = []
    for path in sorted(progress_dir.glob("rank*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records


@dataclass
class ProgressWriter:
    """One worker's progress file; writes at most once per `min_interval_s`.

    Why rate-limited: `er.report()` is called every step, and a step can take
    microseconds; the file only has to be fresh at scrape granularity. Why here: the
    worker writes it and the agent reads it, and the worker side must not import the
    agent.
    """

    path: Path
    min_interval_s: float = 0.5
    _last: dict | None = None
    _written_at: float = float("-inf")

    def write(self, step: int, samples: int, now: float | None = None, *,
              boundary: bool = False, stopping: int | None = None) -> bool:
        """Record the latest numbers if the last write is old enough; True if written.

        `boundary`: this worker stops at a step boundary when asked (the agent's drain
        waits for it, see drain.py). `stopping`: the step at which the job agreed to
        stop; written at once, whatever the rate limit, because the agent waits on it.
        """
        monotonic = time.monotonic()
        if stopping is None and monotonic - self._written_at < self.min_interval_s:
            return False
        record = {"step": int(step), "samples": int(samples),
                  "time": time.time() if now is None else now,
                  "boundary": bool(boundary), "stopping": stopping}
        if self._last is not None and record["step"] >= self._last["step"]:
            record.update({f"prev_{k}": self._last[k] for k in ("step", "samples", "time")})
        try:
            # Readers see the old file or the new, never half. Not durable: rewritten
            # every half second, and nobody reads it after a power loss.
            write_atomic(self.path, json.dumps(record).encode(), durable=False)
        except OSError:
            return False  # progress is advisory: a full disk must not stop training
        self._last, self._written_at = record, monotonic
        return True

    @property
    def last(self) -> dict | None:
        return self._last


# ---- the environment ------------------------------------------------------------------
# Field name -> variable. torchrun's names come first: scripts written for torchrun read them.
_VARIABLES = {
    "rank": "RANK", "local_rank": "LOCAL_RANK", "world_size": "WORLD_SIZE",
    "local_world_size": "LOCAL_WORLD_SIZE", "group_rank": "GROUP_RANK",
    "group_world_size": "GROUP_WORLD_SIZE", "role_rank": "ROLE_RANK",
    "role_world_size": "ROLE_WORLD_SIZE", "role_name": "ROLE_NAME",
    "master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT",
    "restart_count": "TORCHELASTIC_RESTART_COUNT", "max_restarts": "TORCHELASTIC_MAX_RESTARTS",
    "run_id": "TORCHELASTIC_RUN_ID", "run_origin": "ELASTIC_RUN_ORIGIN",
    "use_agent_store": "TORCHELASTIC_USE_AGENT_STORE",
    "error_file": "TORCHELASTIC_ERROR_FILE",
    "signals_to_handle": "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "round": "ELASTIC_RUN_ROUND",
    "etcd_endpoints": "ELASTIC_RUN_ETCD_ENDPOINTS", "etcd_prefix": "ELASTIC_RUN_ETCD_PREFIX",
    "etcd_cacert": "ELASTIC_RUN_ETCD_CACERT", "etcd_cert": "ELASTIC_RUN_ETCD_CERT",
    "etcd_key": "ELASTIC_RUN_ETCD_KEY", "etcd_user": "ELASTIC_RUN_ETCD_USER",
    "etcd_password_file": "ELASTIC_RUN_ETCD_PASSWORD_FILE",
    "notice_path": "ELASTIC_RUN_NOTICE_PATH", "progress_dir": "ELASTIC_RUN_PROGRESS_DIR",
    "events_path": "ELASTIC_RUN_EVENTS_PATH",
    "reform_dir": "ELASTIC_RUN_REFORM_DIR", "collective_timeout_s": "ELASTIC_RUN_COLLECTIVE_TIMEOUT",
    "standby": "ELASTIC_RUN_STANDBY", "formation_timeout_s": "ELASTIC_RUN_FORMATION_TIMEOUT",
    "quick_exit": "ELASTIC_RUN_QUICK_EXIT", "record_socket": "ELASTIC_RUN_RECORD_SOCKET",
}
# What places a worker in a round: a standby worker (reform.py) is started without them.
PLACEMENT_FIELDS = ("rank", "world_size", "group_rank", "group_world_size", "role_rank",
                    "role_world_size", "master_addr", "master_port")
# How the agent runs a Python entry point (cli/run.py builds the argv, agent/prewarm.py
# starts interpreters the same way).
PYTHON_ENTRY = (sys.executable, "-u")
# The module a --prewarm interpreter runs (worker/prewarm.py; agent/prewarm.py starts it).
PREWARM_MODULE = "elastic_runner.worker.prewarm"
# The agent's own secret: never handed to a worker (they get etcd_password_file).
AGENT_ONLY_VARIABLES = ("ELASTIC_RUN_ETCD_PASSWORD",)


@dataclass(frozen=True)
class WorkerEnv:
    """One worker's view of its job. Defaults describe a script run outside any launcher."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_rank: int = 0
    group_world_size: int = 1
    role_rank: int = 0
    role_world_size: int = 1
    role_name: str = "default"
    master_addr: str = ""
    master_port: int = 0
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str = "local"
    # Which launch of the run id (rendezvous/protocol.origin_key): checkpoint manifests
    # carry it, so two launches of one command on two etcds do not share a folder.
    run_origin: str = ""
    # Workers reach rank 0's TCPStore at MASTER_ADDR, never an agent-hosted store.
    use_agent_store: bool = False
    error_file: str = ""
    signals_to_handle: str = DEFAULT_SIGNALS_TO_HANDLE
    round: int = 0
    etcd_endpoints: tuple[str, ...] = ()
    etcd_prefix: str = ""
    etcd_cacert: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    etcd_user: str = ""
    etcd_password_file: str = ""
    notice_path: str = ""
    progress_dir: str = ""
    events_path: str = ""
    # In-process re-formation (reform.py): the channel folder, and how long a collective
    # may block before a worker gives up on a silent peer (0: torch's default).
    reform_dir: str = ""
    collective_timeout_s: int = 0
    # Started before its node joined a round: no place yet, the channel gives it one.
    standby: bool = False
    # How long a re-forming worker waits for the new round's group (0: the collective's).
    formation_timeout_s: int = 0
    # A worker that stops for a resize skips the interpreter's teardown
    # (worker/quick_exit.py): its agent waits for the process to end.
    quick_exit: bool = False
    # Where the agent answers for the checkpoint record (record_relay.py); empty: the
    # worker reads etcd itself.
    record_socket: str = ""

    def to_env(self) -> dict[str, str]:
        """The variables to set; empty optional values are left out, as torchrun does."""
        env = {}
        for name, value in asdict(self).items():
            if isinstance(value, tuple):
                value = ",".join(value)
            elif isinstance(value, bool):
                value = str(value)  # torchrun writes "True"/"False"
            if value != "" or name in ("master_addr",):
                env[_VARIABLES[name]] = str(value)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "WorkerEnv":
        """Read what is there; a missing variable keeps its outside-a-launcher default."""
        values = {}
        for field in fields(cls):
            raw = environ.get(_VARIABLES[field.name])
            if raw is None:
                continue
            default = getattr(cls, field.name, None)
            if isinstance(default, bool):
                values[field.name] = raw.strip().lower() in ("1", "true", "yes")
            elif isinstance(default, int):
                values[field.name] = int(raw) if raw.strip() else default
            elif isinstance(default, tuple):
                values[field.name] = tuple(part for part in raw.split(",") if part)
            else:
                values[field.name] = raw
        return cls(**values)

    @property
    def etcd_options(self) -> dict[str, str]:
        """TLS and user options for the worker's etcd client (the password is a file)."""
        pairs = (("cacert", self.etcd_cacert), ("cert", self.etcd_cert), ("key", self.etcd_key),
                 ("user", self.etcd_user))
        return {name: value for name, value in pairs if value}


def contract_variables() -> frozenset[str]:
    """Every variable of the contract: what the agent sets for each worker."""
    return frozenset(_VARIABLES.values())


def variable(field_name: str) -> str:
    """The environment variable that carries one WorkerEnv field."""
    return _VARIABLES[field_name]
