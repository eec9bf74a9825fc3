"""The worker side: what a training script calls under elastic-run.

`init()` is the worker's entry point, so it is the one place on this side that
reads the environment the agent set (torchrun's variables plus ELASTIC_RUN_*);
everything else receives the resulting `Context`.

Spot notice: when any agent of the job gets a notice, every agent creates the
file named by ELASTIC_RUN_NOTICE_PATH (a file, not a signal: a script that never
called init() must not be killed by an unexpected SIGUSR1). The flag is agreed across ranks by a one-integer all-reduce in
`Checkpointer.due()`, so every rank stops at the same step; rank 0 writes the
checkpoint of that step and every worker exits with EXIT_FOR_RESIZE, which the
agents read as "membership is changing", not as a failure. Zero steps are lost.

Leaving: every way a script can end waits for every pending save of every
Checkpointer made under the context (they are tied to it, like the process
group): `with er.init()` and `er.finish()` close them before leaving the process
group and raise the first failure, which the worker's excepthook prints as one
line (exit 1); a script that just returns is covered by each async Checkpointer's
own atexit handler (checkpoint_async). A worker therefore never exits 0 with a
save pending or failed. After finish() the Checkpointers are closed: they still
load, but no longer save.

The etcd password reaches workers as the path of a 0600 file the agent writes
(ELASTIC_RUN_ETCD_PASSWORD_FILE), never as a variable value: the environment of
a process is readable by its user's other processes and ends up in crash dumps.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from elastic_runner import checkpoint as _checkpoint

log = logging.getLogger("elastic_runner.runtime")

EXIT_FOR_RESIZE = 75  # EX_TEMPFAIL: stopped on purpose for a resize


@dataclass(frozen=True)
class Context:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    restart_count: int
    round: int
    run_id: str
    backend: str
    device: str
    etcd_endpoints: tuple[str, ...] = ()
    etcd_prefix: str = ""
    etcd_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    notice_path: str = ""
    events_path: str = ""
    progress_dir: str = ""
    # The Checkpointers made under this context; finish() waits for and closes them.
    checkpointers: list = field(default_factory=list, init=False, compare=False, repr=False)

    def notice_given(self) -> bool:
        return bool(self.notice_path) and os.path.exists(self.notice_path)

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, kind, error, trace) -> None:
        """A failed save fails the worker, unless the block already fails it: then
        the block's error is the one reported and the save's is logged."""
        if kind is None or (kind is SystemExit and error.code in (None, 0)):
            finish()
            return
        try:
            finish()
        except Exception as save_error:
            log.error("%s", save_error)


_active: list[Context] = []  # the process's one context, like torch's default group


def context_from_env(environ: Mapping[str, str], backend: str, device: str) -> Context:
    endpoints = tuple(e for e in environ.get("ELASTIC_RUN_ETCD_ENDPOINTS", "").split(",") if e)
    return Context(
        rank=int(environ.get("RANK", 0)), local_rank=int(environ.get("LOCAL_RANK", 0)),
        world_size=int(environ.get("WORLD_SIZE", 1)),
        local_world_size=int(environ.get("LOCAL_WORLD_SIZE", 1)),
        restart_count=int(environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        round=int(environ.get("ELASTIC_RUN_ROUND", 0)),
        run_id=environ.get("TORCHELASTIC_RUN_ID", "local"), backend=backend, device=device,
        etcd_endpoints=endpoints, etcd_prefix=environ.get("ELASTIC_RUN_ETCD_PREFIX", ""),
        etcd_options=_etcd_options(environ),
        notice_path=environ.get("ELASTIC_RUN_NOTICE_PATH", ""),
        events_path=environ.get("ELASTIC_RUN_EVENTS_PATH", ""),
        progress_dir=environ.get("ELASTIC_RUN_PROGRESS_DIR", ""))


def _etcd_options(environ: Mapping[str, str]) -> dict[str, str]:
    """TLS files and user as given; the password from the agent's 0600 file. An
    unreadable file leaves the password out: etcd then says what is wrong."""
    options = {k: environ[v] for k, v in (("cacert", "ELASTIC_RUN_ETCD_CACERT"),
                                          ("cert", "ELASTIC_RUN_ETCD_CERT"),
                                          ("key", "ELASTIC_RUN_ETCD_KEY"),
                                          ("user", "ELASTIC_RUN_ETCD_USER"))
               if environ.get(v)}
    password_file = environ.get("ELASTIC_RUN_ETCD_PASSWORD_FILE")
    if password_file:
        try:
            options["password"] = Path(password_file).read_text().rstrip("\r\n")
        except OSError as exc:
            log.warning("cannot read the etcd password file %s (%s): connecting without "
                        "a password", password_file, exc.strerror or exc)
    return options


def init(backend: str | None = None, timeout_s: float = 60.0) -> Context:
    """Join the process group the launcher prepared; bind this worker's GPU.

    The agent shows each worker only its own GPU (CUDA_VISIBLE_DEVICES), so the
    device is cuda:0 whenever exactly one is visible, else cuda:LOCAL_RANK.
    """
    import torch
    import torch.distributed as dist

    environ = dict(os.environ)
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    device = "cpu"
    if cuda:
        index = 0 if torch.cuda.device_count() == 1 else int(environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        device = f"cuda:{index}"
    context = context_from_env(environ, backend, device)
    if dist.is_initialized():
        _warn_on_hand_typed_ranks(dist.get_rank(), dist.get_world_size(), context)
    elif context.world_size > 1 or "MASTER_ADDR" in environ:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    _active[:] = [context]
    _report_our_errors_in_one_line()
    log.info("rank %d/%d (local %d) on %s, round %d, restarts %d", context.rank,
             context.world_size, context.local_rank, device, context.round, context.restart_count)
    return context


def _report_our_errors_in_one_line() -> None:
    """An elastic-runner error in a worker (bad checkpoint dir, stale writer) is a
    message for the user, not a traceback: print it as one line, exit 1."""
    from elastic_runner.errors import ElasticRunError

    previous = sys.excepthook

    def hook(kind, error, trace):
        if isinstance(error, ElasticRunError):
            print(f"elastic-run worker: error: {error}", file=sys.stderr, flush=True)
        else:
            previous(kind, error, trace)

    sys.excepthook = hook


def _warn_on_hand_typed_ranks(rank: int, world_size: int, context: Context) -> None:
    """The script built its own process group: say so when it disagrees with the plan."""
    if (rank, world_size) != (context.rank, context.world_size):
        log.warning("the process group was initialised by hand as rank %d of %d, but the "
                    "launcher assigned rank %d of %d: drop the hand-typed rank/world_size and "
                    "call er.init() (or init_process_group() with no rank)", rank, world_size,
                    context.rank, context.world_size)


def finish() -> None:
    """Wait for every pending save, then leave the process group cleanly so peers
    don't see a crash.

    Raises:
        CheckpointError: a save of this process failed (the first one; the others
            are logged). The group is left and the context cleared first.
    """
    import torch.distributed as dist

    context = current()
    failure = _close_checkpointers(context) if context is not None else None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _active.clear()
    if failure is not None:
        raise failure


def _close_checkpointers(context: Context) -> Exception | None:
    failure = None
    while context.checkpointers:
        try:
            context.checkpointers.pop(0).close()
        except Exception as error:  # noqa: BLE001 - every one must be closed
            if failure is None:
                failure = error
            else:
                log.error("another checkpoint save failed too: %s", error)
    return failure


def current() -> Context | None:
    return _active[0] if _active else None


class EtcdLatestStore:
    """The newest verified checkpoint recorded in etcd, fenced by the round.

    publish() succeeds only while the next round has no plan yet: a node whose
    round is over cannot overwrite the record of the job that re-formed without
    it, yet workers draining for a resize (next round open, not closed) can
    still record the checkpoint the next round resumes from. retract() is fenced
    the same way.
    """

    def __init__(self, context: Context):
        from elastic_runner.config import EtcdConfig
        from elastic_runner.etcd.client import EtcdClient

        self._client = EtcdClient(EtcdConfig(context.etcd_endpoints, 5.0, 10.0,
                                             **context.etcd_options))
        self._key = f"{context.etcd_prefix}checkpoint/latest"
        self._next_plan_key = f"{context.etcd_prefix}rounds/{context.round + 1}/plan"

    def read(self) -> dict | None:
        kv = self._client.get(self._key)
        return json.loads(kv.value) if kv else None

    def publish(self, record: dict) -> bool:
        from elastic_runner.etcd.client import Put, key_missing, mod_revision_is

        current = self._client.get(self._key)
        if current is not None and json.loads(current.value).get("step", -1) > record["step"]:
            return False
        guard = (mod_revision_is(self._key, current.mod_revision) if current
                 else key_missing(self._key))
        if self._client.txn([key_missing(self._next_plan_key), guard],
                            [Put(self._key, json.dumps(record).encode())]).succeeded:
            return True
        return self.read() == record  # a retried transaction that had already landed

    def retract(self, bad: dict, replacement: dict) -> bool:
        """Swap the record only while it is still exactly `bad`: racing readers agree."""
        from elastic_runner.etcd.client import Put, key_missing, mod_revision_is

        current = self._client.get(self._key)
        if current is None or json.loads(current.value) != bad:
            return False
        return self._client.txn(
            [key_missing(self._next_plan_key), mod_revision_is(self._key, current.mod_revision)],
            [Put(self._key, json.dumps(replacement).encode())]).succeeded


def _write_checkpoint_progress(folder: str, step: int, url: str, duration_s: float) -> None:
    """The agent's metrics read this for checkpoint age and save time (rank 0's node)."""
    path = os.path.join(folder, "checkpoint.json")
    temporary = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"  # writer threads
    try:
        with open(temporary, "w") as handle:
            json.dump({"step": step, "url": url, "time": time.time(),
                       "duration_s": duration_s}, handle)
        os.replace(temporary, path)
    except OSError as exc:
        log.debug("checkpoint progress not written: %s", exc)


class Checkpointer(_checkpoint.Checkpointer):
    """A Checkpointer that knows the job: etcd record, spot notices, resize exits."""

    def __init__(self, url_or_path, keep: int | None = 3, every: int | None = None,
                 async_save: bool = False, rank: int | None = None, latest_store=None, **kwargs):
        context = current()
        if latest_store is None and context is not None and context.etcd_endpoints:
            latest_store = EtcdLatestStore(context)
        super().__init__(url_or_path, keep=keep, every=every, async_save=async_save, rank=rank,
                         latest_store=latest_store, **kwargs)
        self._context = context
        self._stopping = False
        if context is not None:
            context.checkpointers.append(self)
        self._events = None
        if context is not None and context.events_path:
            from elastic_runner.events import EventLog
            self._events = EventLog(f"rank{context.rank}", context.run_id,
                                    Path(context.events_path))
        if context is not None and context.notice_path:
            # Tells the agent these workers act on a notice (checkpoint, then exit).
            open(context.notice_path + ".ready", "a").close()

    def due(self, step: int) -> bool:
        if self._notice_agreed():
            self._stopping = True
            self.request_save()
        return super().due(step)

    def load_latest(self) -> Any:
        state = super().load_latest()
        if self._events is not None and self.rank == 0 and self.loaded_step is not None:
            self._events.emit("checkpoint_loaded", step=self.loaded_step,
                              round=self._context.round)
        return state

    def save(self, step: int, state_dict: Any) -> str | None:
        where = super().save(step, state_dict)
        if self._stopping:
            self.wait()
            log.warning("spot notice: checkpoint of step %d written; stopping for the resize", step)
            finish()
            raise SystemExit(EXIT_FOR_RESIZE)
        return where

    def _saved(self, step: int, url: str, duration_s: float) -> None:
        """Verified and published: only now may the event log and metrics say so.
        Runs in the writer thread for async saves (EventLog.emit is thread-safe)."""
        if self._events is not None:
            self._events.emit("checkpoint_saved", step=step, url=url,
                              round=self._context.round, notice=self._stopping,
                              duration_s=duration_s)
        if self._context is not None and self._context.progress_dir:
            _write_checkpoint_progress(self._context.progress_dir, step, url, duration_s)

    def _exit_line(self, error: BaseException) -> str:
        return f"elastic-run worker: error: {error}"

    def _notice_agreed(self) -> bool:
        """Every rank learns at the same step whether any rank got a notice."""
        if self._context is None:
            return False
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self._context.notice_given() else 0], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            if self._context.backend == "nccl":
                flag = flag.to(self._context.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


_progress: list = []  # the process's one (rank, ProgressWriter | None), made on first report()


def report(step: int, samples: int) -> None:
    """Tell the agent how far this rank is, for its steps/s and samples/s metrics.

    Cheap enough for every step: no collective, no etcd, at most one small file
    write (temp file + rename) per 0.5 s, and the environment is read once per
    process, not per call. A no-op outside elastic-run (no ELASTIC_RUN_PROGRESS_DIR).
    `samples` counts the samples this rank has trained so far.
    """
    context = current()
    if not _progress or (context is not None and _progress[0][0] != context.rank):
        from elastic_runner.metrics import ProgressWriter

        directory = os.environ.get("ELASTIC_RUN_PROGRESS_DIR", "")
        rank = context.rank if context is not None else int(os.environ.get("RANK", 0))
        writer = ProgressWriter(Path(directory) / f"rank{rank}.json") if directory else None
        _progress[:] = [(rank, writer)]
    writer = _progress[0][1]
    if writer is not None:
        writer.write(step, samples)
