"""er.Checkpointer: the checkpointer that knows its job.

The generic Checkpointer (checkpoint/checkpointer.py) knows files, manifests and a
latest record. Under elastic-run a checkpointer also belongs to the worker's Context:
its record lives in etcd and is fenced by the round, the runtime saves its registered
objects when every rank agreed to stop for a resize, its saves feed the agent's events
and metrics, and an in-process re-formation (er.elastic) rebinds it to the new round.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from elastic_runner.contract import CHECKPOINT_RECORD
from elastic_runner.errors import CheckpointError, StaleWriterError
from elastic_runner.files import write_atomic
from elastic_runner.reform import STANDBY_ROUND
from elastic_runner.worker.checkpoint import checkpointer as _checkpoint
from elastic_runner.worker.checkpoint.background import BackgroundWriter
from elastic_runner.worker.checkpoint.etcd_store import EtcdLatestStore, RelayedLatestStore
from elastic_runner.worker.checkpoint.objects import holds_objects, state_of
from elastic_runner.worker.checkpoint.pending_record import PendingRecord
from elastic_runner.worker.checkpoint.storage import Storage
from elastic_runner.worker.quick_exit import exit_for_resize
from elastic_runner.worker.runtime import Context, current, finish

# The runtime's name: a user filters the worker's lines by it, whichever module speaks.
log = logging.getLogger("elastic_runner.worker.runtime")


def _write_checkpoint_progress(folder: str, step: int, url: str, duration_s: float) -> None:
    """The agent's metrics read this for checkpoint age and save time (rank 0's node)."""
    record = {"step": step, "url": url, "time": time.time(), "duration_s": duration_s}
    try:
        # Not durable: a metrics input, rewritten after every save.
        write_atomic(os.path.join(folder, CHECKPOINT_RECORD), json.dumps(record).encode(),
                     durable=False)
    except OSError as exc:
        log.debug("checkpoint progress not written: %s", exc)


class Checkpointer(_checkpoint.Checkpointer):
    """A Checkpointer that knows the job: etcd record, resizes, registered state.

    State for a resize: the runtime saves, at the step every rank agreed to stop,
    whatever was registered: the objects passed to `save(step, objects)` or
    `restore(objects)` (anything with state_dict()), or `register(...)`. A script that
    only ever passes finished state dicts gives the runtime nothing current to save;
    it resumes from its last checkpoint and says so once.
    """

    def __init__(self, url_or_path, keep: int | None = 3, every: int | None = None,
                 async_save: bool = False, rank: int | None = None, latest_store=None, **kwargs):
        context = current()
        if rank is None and context is not None and context.round == STANDBY_ROUND:
            rank = -1  # standby (reform.py): only a reader until rebind() gives it a place
        # The record we open ourselves is fenced by the round: rebind() reopens it.
        self._own_store = latest_store is None and context is not None and bool(
            context.etcd_endpoints)
        if self._own_store:
            _one_recorded_folder(context, url_or_path, kwargs.get("storage_options"))
            writer = (context.rank if rank is None else rank) == 0
            latest_store = _etcd_store(context, writer)
        if context is not None:  # its manifests name the run: folder_claim.py
            kwargs.setdefault("run_id", context.run_id)
            kwargs.setdefault("run_origin", context.run_origin or None)
        super().__init__(url_or_path, keep=keep, every=every, async_save=async_save, rank=rank,
                         latest_store=latest_store, **kwargs)
        self._context = context
        self._stopping = False
        self._registered: Any = None
        self._last_saved: int | None = None
        self._asks_due = False
        self._replaced_on: str | None = None  # the folder, once a newer one took it
        if context is not None:
            context.checkpointers.append(self)  # first: closed at finish() if the next fails
            _retire_older_on_the_same_folder(context, self)
        self._events = _event_log(context)

    def rebind(self) -> None:
        """The job re-formed in place (Context.move): same process, new rank, world
        size and round. A save in flight ends first, as the old round's (its record
        may be refused now that the new round has a plan: the state stays in memory,
        so that is a warning); the new rank 0 probes the root and writes from now on."""
        try:
            self.wait()
        except StaleWriterError as error:
            log.warning("%s (training goes on from the state in memory)", error)
        context = self._context
        self.rank, self._world_size = context.rank, context.world_size
        if self.rank != 0:  # not the writer now: the new rank 0 records with its next save
            self._pending = PendingRecord()
        if self._sharded is not None:
            self._sharded.rebind()
        if (self.rank == 0 or self._sharded is not None) and not self._closed:
            self._storage.probe()
            if self.config.async_save and self._writer is None:
                self._writer = BackgroundWriter(self._exit_line)
        if self._own_store:
            self._latest.close()
            # No etcd client in the pause: a new rank 0 opens its own at its first save.
            self._latest = _etcd_store(context, writer=False)
        self._events = _event_log(context)

    def close(self) -> None:
        """The last save first (as before), then the etcd client this checkpointer
        opened for its record, so that no gRPC channel is left to the interpreter's
        teardown. A worker that exited 0 after its last step was once ended by SIGABRT
        there ("terminate called without an active exception", a resize-matrix run;
        gRPC's C core is known to abort in a teardown with channels open): the agent
        took it for a failure and the round's tail was trained again."""
        closing = not self._closed
        try:
            super().close()
        finally:
            if closing and self._own_store:
                self._latest.close()

    def register(self, state: Any) -> None:
        """What to save when the runtime stops for a resize: a mapping of name ->
        object with state_dict() (or plain value), or a function returning the state."""
        self._registered = state

    def due(self, step: int) -> bool:
        """True when `every` says so, or (scripts without ElasticSampler) when the job
        agreed to stop at this step; save() then writes it and exits for the resize."""
        self._asks_due = True
        boundary = self._context.boundary if self._context is not None else None
        if boundary is not None and boundary.enabled and not boundary.active:
            boundary.due_driven = True
            if boundary.agree_now():
                self._stopping = True
                self.request_save()
            boundary.write(step, None, stopping=step if self._stopping else None)
        return super().due(step)

    def save(self, step: int, state_dict: Any) -> str | None:
        """Write checkpoint `step`. Given objects (modules, optimizers, the sampler),
        their state_dict() is saved and they are registered for resizes.

        Under er.elastic, a save the latest store refuses returns None with a warning
        instead of raising StaleWriterError: a round can close while rank 0 saves the
        step in flight, and the worker outlives its round, so ending it for a durable
        copy its peers still hold in memory would turn a re-formation into a restart."""
        if self._replaced_on is not None:
            raise CheckpointError(
                f"this er.Checkpointer on {self._replaced_on} was replaced by a newer one made "
                "on the same folder, and saves no more: two Checkpointers on one folder write "
                "the same step directories, so each save of a step would replace the other's "
                "(and each one's tidying deletes the other's steps). Save every object through "
                "one Checkpointer (save(step, {'model': ..., 'ema': ...})), or give each its "
                "own folder")
        if holds_objects(state_dict):
            self._registered = state_dict
        try:
            where = super().save(step, state_dict if self.config.sharded else state_of(state_dict))
        except StaleWriterError as error:
            if not self._re_forms_in_place():
                raise
            log.warning("checkpoint step %s not recorded: the latest store refused it (this "
                        "round is over, or a newer step is recorded); under er.elastic training "
                        "goes on from the state in memory, and the first save after the "
                        "re-formation records it", error.step)
            return None
        self._last_saved = step
        if self._stopping:
            self.wait()
            log.warning("spot notice: checkpoint of step %d written; stopping for the resize", step)
            finish()
            exit_for_resize()
        return where

    def restore(self, objects: Mapping[str, Any], allow_missing: Iterable[str] = ()
                ) -> int | None:
        """Load the newest verified checkpoint into `objects` (each entry's
        load_state_dict) and register them; return its step, or None if there is none.
        `allow_missing`: names of objects new in this script, which the checkpoint may
        lack (any other it lacks is a CheckpointError, nothing loaded)."""
        self._registered = objects
        step = super().restore(objects, allow_missing)
        if self.config.sharded:
            self._emit_loaded()
        return step

    def _re_forms_in_place(self) -> bool:
        """This worker runs under er.elastic: its round ends in a re-formation, not an exit."""
        return self._context is not None and self._context.boundary.in_place

    def defers_to_due(self) -> bool:
        """Nothing registered, but the script asks due() every step: let it save."""
        return self._registered is None and self._asks_due

    def stop_at_next_save(self) -> None:
        self._stopping = True
        self.request_save()

    def save_for_resize(self, step: int) -> bool:
        """At an agreed stop: rank 0 (sharded: every rank) saves the registered state of
        `step` and waits for it. True when a checkpoint of `step` exists (saved now or before)."""
        if (self.rank != 0 and not self.config.sharded) or self._closed:
            return self._registered is not None
        if self._last_saved == step:
            self.wait()
            return True
        if self._registered is None:
            log.warning("resize at step %d: nothing registered with the Checkpointer, so "
                        "the steps since the last checkpoint are redone; pass the objects "
                        "(not their state_dict()) to save() or restore(), or call register()",
                        step)
            return False
        registered = self._registered() if callable(self._registered) else self._registered
        self.save(step, registered)
        self.wait()
        return True

    def load_latest(self) -> Any:
        state = super().load_latest()
        self._emit_loaded()
        return state

    def _emit_loaded(self) -> None:
        if self._events is not None and self.rank == 0 and self.loaded_step is not None:
            self._events.emit("checkpoint_loaded", step=self.loaded_step,
                              round=self._context.round)

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


def _etcd_store(context: Context, writer: bool) -> EtcdLatestStore | RelayedLatestStore:
    """The writer (rank 0 at a start) keeps its own connection, opened and used at its
    first read as before: a save for a resize must not wait for an etcd client's import
    and connection (a slow save can lose the race with the next round's close, which
    fences it). Every other rank asks its agent (record_relay.py)."""
    def own_client() -> EtcdLatestStore:
        return EtcdLatestStore(context.etcd_endpoints, context.etcd_prefix, context.round,
                               context.etcd_options)

    if context.record_socket and not writer:
        return RelayedLatestStore(context.record_socket, own_client)
    return own_client()


def _one_recorded_folder(context: Context, url_or_path: Any,
                         storage_options: Mapping[str, Any] | None) -> None:
    """Why one folder per job records in etcd: etcd holds one record of the run's
    newest checkpoint. A second er.Checkpointer on another folder published into it
    too: a save of a step the other had recorded was refused as a "stale writer", and
    each loaded the other's newest step, which its own folder lacks."""
    recording = [c for c in context.checkpointers if c._own_store and not c._closed]
    if not recording:
        return
    storage = Storage(os.fspath(url_or_path), storage_options or {})
    mine = storage.url(storage.root)
    for other in recording:
        theirs = other._storage.url(other._storage.root)
        if _folder_of(other._storage) != _folder_of(storage):
            raise CheckpointError(
                f"this job already records its checkpoints in etcd from {theirs}, and etcd "
                f"keeps one record of a run's newest checkpoint, so a second er.Checkpointer "
                f"on {mine} cannot have one too: save every object through one Checkpointer "
                "(save(step, {'model': ..., 'ema': ...})), or give this one a record of its "
                f"own: er.Checkpointer({os.fspath(url_or_path)!r}, "
                "latest_store=er.MemoryLatestStore())")


def _folder_of(storage: Storage) -> str:
    """One name per folder: a local one through its symlinks."""
    return os.path.realpath(storage.root) if storage.local else storage.url(storage.root)


def _retire_older_on_the_same_folder(context: Context, newer: Checkpointer) -> None:
    """The newest er.Checkpointer made on a folder is the one that writes there: an
    older one is closed (its save in flight finished first) and refuses to save again.

    Why: a model's and an EMA's Checkpointer on one folder both wrote step-N, the later
    replacing the earlier, so the model's step held the EMA's state, and each one's
    tidying deleted the other's steps. Why not refuse the newer one instead: a script
    that makes its Checkpointer again (inside train(), called again after each
    re-formation) never saves through the older one, and must not fail.
    """
    folder = _folder_of(newer._storage)
    for older in [c for c in context.checkpointers
                  if c is not newer and _folder_of(c._storage) == folder]:
        context.checkpointers.remove(older)
        older._replaced_on = newer._storage.url(newer._storage.root)
        older.close()  # an error of its last save is this script's to see, here


def _event_log(context: Context | None):
    if context is None or not context.events_path:
        return None
    from elastic_runner.events import EventLog
    return EventLog(f"rank{context.rank}", context.run_id, Path(context.events_path))
