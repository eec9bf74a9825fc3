"""Crash-safe, fenced checkpoints for elastic training.

Every restart resumes from what rank 0 last committed, so a checkpoint must be
complete and verified or ignored, and a writer whose round is over must not
replace a newer record. Payloads are hashed, written under temporary names,
renamed into place and committed by writing MANIFEST.json last::

    <root>/step-00000123/state.pt        torch.save bytes
    <root>/step-00000123/MANIFEST.json   {"format": 1, "step", "sha256", "bytes",
                                          "created", "world_size", "run_id", "run_origin"}

Every rank's `load_latest()` reads the same root (and `latest_store`), so all
ranks resolve the same step as long as no save is in flight: saves happen during
training, loads at start.

A save counts only once it is durable: written, read back and verified, and
published to `latest_store`. Only then is `_saved()` called (the runtime logs
`checkpoint_saved` there), from the writer thread for async saves. One the store
cannot record for an outage (etcd full or gone) is kept on storage, unrecorded and
untidied, and training goes on: pending_record.py. An async save
that fails is raised, as a `CheckpointError` naming the step and the cause, by
the next `save()`, `due()`, `wait()` or `close()`, or at interpreter exit
(checkpoint_async), so a worker never exits 0 with its last checkpoint missing.

A record whose checkpoint fails verification is retracted by rank 0's
`load_latest()` (see checkpoint_latest), so it stops fencing the steps that are
about to be redone. After each successful save (and never before it is published)
the writer tidies older steps: verdicts.py has the rules, shared with the sharded
format (sharded.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from numbers import Integral
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

from elastic_runner.worker.checkpoint.background import BackgroundWriter
from elastic_runner.worker.checkpoint.objects import check_save_arguments, load_into, snapshot
from elastic_runner.worker.checkpoint.latest import (
    NO_CHECKPOINT, LatestStore, MemoryLatestStore, names_no_checkpoint, refuses,
)
from elastic_runner.worker.checkpoint import verdicts
from elastic_runner.worker.checkpoint.folder_claim import FolderClaim
from elastic_runner.worker.checkpoint.pending_record import PendingRecord
from elastic_runner.worker.checkpoint.storage import Storage as _Storage
from elastic_runner.worker.checkpoint.verdicts import (
    MANIFEST_FILE, OtherFormat, Unreadable, Unverified,
)
from elastic_runner.errors import CheckpointError, CheckpointWriteError, StaleWriterError

__all__ = ["CheckpointConfig", "CheckpointError", "CheckpointWriteError", "Checkpointer",
           "LatestStore", "MemoryLatestStore", "StaleWriterError"]

log = logging.getLogger("elastic_runner.worker.checkpoint.checkpointer")

FORMAT = 1
STATE_FILE = "state.pt"
_SKIPPED = object()


@dataclass(frozen=True)
class CheckpointConfig:
    """Policy knobs, validated once so a bad value fails at construction."""

    keep: int | None = 3
    every: int | None = None
    async_save: bool = False
    weights_only: bool = True
    sharded: bool = False

    def __post_init__(self) -> None:
        for name in ("keep", "every"):  # keep=1.5 tidied to one step; every="10" crashed
            value = getattr(self, name)
            if value is not None and (not isinstance(value, Integral) or value is True
                                      or value is False or value < 1):
                raise ValueError(f"{name} must be a whole number >= 1 or None, got {value!r}")
        for name in ("async_save", "weights_only", "sharded"):  # "False" (a string) is true
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


class Checkpointer:
    """Rank-0 writer and all-rank reader of verified checkpoints.

    Use it from the training thread only; its one background thread
    (async_save) is internal.
    """

    def __init__(self, url_or_path: str | os.PathLike[str], keep: int | None = 3,
                 every: int | None = None, async_save: bool = False, rank: int | None = None,
                 latest_store: LatestStore | None = None, *, weights_only: bool = True,
                 world_size: int | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 sharded: bool = False, run_id: str | None = None,
                 run_origin: str | None = None) -> None:
        """Open the root; rank 0 proves it can write there now, not at step N.

        Args:
            url_or_path: plain path or fsspec URL (file://, memory://, s3://, ...).
            keep: verified checkpoints retained after a save; None keeps all.
            every: due(step) is True when step % every == 0; None: only on request.
            async_save: snapshot to CPU in save(), write in a background thread.
            rank: defaults to the torch.distributed rank, else 0.
            latest_store: CAS record that fences stale writers; see LatestStore.
            weights_only: for torch.load; False only if the storage is trusted.
            world_size: recorded in the manifest; defaults to torch.distributed's.
            storage_options: passed to fsspec (credentials, endpoints).
            sharded: every rank writes its own shards with torch.distributed.checkpoint
                and restore(objects) reshards them (sharded.py); needs a process group.
            run_id, run_origin: named in each manifest; another run's steps (or another
                launch's of this run id) are then neither overwritten nor tidied away.

        Raises:
            CheckpointError: rank 0 (sharded: any rank) cannot write to the root, no
                fsspec backend, or sharded=True without a process group.
        """
        self.config = CheckpointConfig(keep, every, async_save, weights_only, sharded)
        dist_rank, dist_world = _dist_rank_and_size()
        self.rank = dist_rank if rank is None else rank
        self._world_size = dist_world if world_size is None else world_size
        self._storage = _Storage(os.fspath(url_or_path), storage_options or {})
        self._latest = latest_store
        self._pending = PendingRecord()  # a save the store could not record yet (outage)
        self._claim = FolderClaim(self._storage, run_id, self._dir, run_origin)
        self._requested = threading.Event()
        self._verified: dict[int, str] = {}  # step -> sha256 already hashed
        self._writer: BackgroundWriter | None = None  # async_save on rank 0
        self.loaded_step: int | None = None
        self._loaded_record: dict[str, Any] | None = None
        self._closed = False
        self._sharded = None  # sharded.ShardedFormat: every rank writes, so every rank probes
        if sharded:
            from elastic_runner.worker.checkpoint.sharded import ShardedFormat

            self._sharded = ShardedFormat(self, storage_options or {})
        if self.rank == 0 or sharded:
            self._storage.probe()
            if async_save:
                self._writer = BackgroundWriter(self._exit_line)

    def due(self, step: int) -> bool:
        """Stays True after request_save() until a save happens, so none is lost.

        Raises:
            CheckpointError: the previous async save failed (checked without waiting).
        """
        if self._writer is not None:
            self._writer.collect(block=False)
        if self._requested.is_set():
            return True
        return self.config.every is not None and step % self.config.every == 0

    def request_save(self) -> None:
        """Thread-safe: a spot notice asks for a save at the next step boundary."""
        self._requested.set()

    def save(self, step: int, state_dict: Any) -> str | None:
        """Write `state_dict` as checkpoint `step` (rank 0 only).

        Returns:
            The checkpoint directory URL on rank 0 (async: valid once wait()
            returns), None on other ranks.

        Raises:
            CheckpointWriteError: the write failed; earlier checkpoints intact.
            StaleWriterError: the latest store refused the record.
            CheckpointError: raised by the previous async save, reported here;
                this save is then not started.

        Sharded: every rank calls it with the objects themselves (modules,
        optimizers, the sampler), not their state_dict(), and gets the URL.
        """
        if self._sharded is not None:
            return self._save_sharded(step, state_dict)
        if self.rank != 0:
            self._requested.clear()
            return None
        if self._closed:
            raise CheckpointError("save() on a closed Checkpointer")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if self._writer is None:
            self._write(step, state_dict)
        else:
            self._writer.collect()
            self._writer.submit(step, self._write, step, snapshot(state_dict, {}))
        self._requested.clear()
        return self._storage.url(self._dir(step))

    def _save_sharded(self, step: int, objects: Any) -> str:
        if self._closed:
            raise CheckpointError("save() on a closed Checkpointer")
        check_save_arguments(step, objects)
        if self._writer is not None:
            self._writer.collect()
        where = self._sharded.save(step, objects)
        self._requested.clear()
        return where

    def restore(self, objects: Mapping[str, Any], allow_missing: Iterable[str] = ()) -> int | None:
        """Load the newest verified checkpoint into `objects` (each one's
        load_state_dict); return its step, or None if there is none. Both formats:
        sharded, every rank takes part and the shards are resharded to this world.
        A CheckpointError, with nothing loaded, where it holds nothing for an object not
        in `allow_missing` (objects.check_names_held says why).
        """
        allow_missing = (allow_missing,) if isinstance(allow_missing, str) else tuple(allow_missing)
        if self._sharded is not None:
            if self._writer is not None:  # our own save; its error stays for wait()
                self._writer.settle()
            return self._sharded.restore(objects, self.config.weights_only, allow_missing)
        state = self.load_latest()
        if state is not None:
            load_into(objects, state, self._storage.url(self._dir(self.loaded_step)),
                      self.loaded_step, allow_missing)
        return self.loaded_step

    def wait(self) -> None:
        """Block until the in-flight async save is done; re-raise its error once."""
        if self._writer is not None:
            self._writer.collect()

    def close(self) -> None:
        """Finish the in-flight save so a clean exit never loses the last one.

        A second call does nothing; an error is raised by the first only.
        """
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.close()
        if self._latest is not None and not self._pending.offer_last(self._latest.publish):
            raise self._stale(self._pending.record["step"])

    def load_latest(self) -> Any:
        """Payload of the newest verified checkpoint, or None if there is none.

        A store record wins over the directory scan, because newer files were
        never published (crash before publish, or a fenced writer); if the
        record does not verify, only older steps are scanned, and rank 0
        retracts the record so it no longer fences the steps to be redone.
        Corrupt and uncommitted checkpoints are skipped with one warning each.

        Raises:
            CheckpointError: a checkpoint passed its sha256 check but torch.load
                refused it (e.g. custom classes with weights_only=True). Falling
                back would silently throw away training progress.
        """
        if self._sharded is not None:
            raise CheckpointError("a sharded checkpoint loads into the objects themselves: "
                                  "call restore({'model': model, 'optim': opt, ...})")
        if self._writer is not None:  # our own save; its error stays for wait()
            self._writer.settle()
        self.loaded_step, self._loaded_record = None, None
        self._claim.loading()
        record = self._latest.read() if self._latest is not None else None
        if record is not None and names_no_checkpoint(record):
            return None  # retracted, and nothing older verified: start afresh
        below = None
        if record is not None:
            below = int(record["step"])
            if not self._storage.fs.exists(self._dir(below)):
                raise verdicts.absent_recorded_step(self._storage, record)
            state = self._try_load(below, expect_sha=record.get("sha256"))
            if state is not _SKIPPED:
                return state
        state = self._scan(below)
        if record is not None:
            self._retract(record)
        return state

    # ---- reading ---------------------------------------------------------------------
    def _dir(self, step: int) -> str:
        return f"{self._storage.root}/step-{step:08d}"

    def _scan(self, below: int | None) -> Any:
        for step in self._storage.steps():
            if below is None or step < below:
                state = self._try_load(step)
                if state is not _SKIPPED:
                    return state
        return None

    def _retract(self, bad: dict[str, Any]) -> None:
        """Stop a record whose checkpoint failed verification from fencing saves.

        Only rank 0, the one writer, does it: only its fence matters, and a rank
        on a node with a broken mount must not be able to erase the job's history.
        """
        if self.rank != 0:
            return
        replacement = self._loaded_record or NO_CHECKPOINT
        retract = getattr(self._latest, "retract", None)
        if retract is None:
            log.warning("the latest_store record of step %s does not verify, and %s cannot "
                        "retract it: saves up to that step will be refused", bad.get("step"),
                        type(self._latest).__name__)
        elif retract(bad, replacement):  # the skip was the warning; this is detail
            log.info("retracted the latest_store record of step %s (its checkpoint does "
                        "not verify); it now names %s, and training redoes the steps after it",
                        bad.get("step"), f"step {replacement['step']}"
                        if not names_no_checkpoint(replacement) else "no checkpoint")

    def _try_load(self, step: int, expect_sha: str | None = None) -> Any:
        path = self._dir(step)
        self._claim.examined(step)
        try:
            manifest = self._manifest(step)
            if expect_sha is not None and manifest["sha256"] != expect_sha:
                raise Unverified("its sha256 differs from the latest_store record")
            data = self._read_state(step)
            verdicts.check_digest(STATE_FILE, manifest, len(data), hashlib.sha256(data).hexdigest())
        except OtherFormat as exc:
            raise CheckpointError(f"checkpoint {self._storage.url(path)} {exc}: open it with "
                                  "er.Checkpointer(url, sharded=True), or save elsewhere") from None
        except Unverified as exc:
            if isinstance(exc, Unreadable) and expect_sha is not None:  # the recorded step
                raise verdicts.unreadable_recorded_step(self._storage.url(path), step,
                                                        exc) from None
            log.warning("skipping checkpoint %s: %s", self._storage.url(path), exc)
            return _SKIPPED
        self._verified[step] = manifest["sha256"]
        state = self._deserialize(data, path)
        self.loaded_step, self._loaded_record = step, self._record_of(step, manifest)
        return state

    def _read_state(self, step: int) -> bytes:
        try:
            return self._storage.fs.cat_file(f"{self._dir(step)}/{STATE_FILE}")
        except FileNotFoundError:
            raise Unverified(f"no {STATE_FILE}") from None
        except OSError as exc:
            raise Unreadable(f"cannot read {STATE_FILE}: {exc}") from None

    def _deserialize(self, data: bytes, path: str) -> Any:
        # map_location=cpu: a checkpoint saved on cuda:N must load on any node.
        try:
            return torch.load(
                io.BytesIO(data), map_location="cpu", weights_only=self.config.weights_only
            )
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {self._storage.url(path)} is intact (sha256 matches) but "
                f"torch.load failed: {exc}. If it holds custom classes, allow them with "
                "torch.serialization.add_safe_globals, or pass weights_only=False only "
                "if you trust the storage."
            ) from exc

    def _manifest(self, step: int) -> dict[str, Any]:
        path = f"{self._dir(step)}/{MANIFEST_FILE}"
        try:
            m = json.loads(self._storage.fs.cat_file(path))
            ok = m["format"] == FORMAT and m["step"] == step
            ok = ok and isinstance(m["sha256"], str) and isinstance(m["bytes"], int)
        except FileNotFoundError:
            raise Unverified(f"no {MANIFEST_FILE}: the save never committed") from None
        except OSError as exc:
            raise Unreadable(f"cannot read {MANIFEST_FILE}: {exc}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise Unverified(f"unreadable {MANIFEST_FILE}: {exc!r}") from None
        if not ok and m.get("format") == "sharded":
            raise OtherFormat("was saved with sharded=True")
        if not ok:
            raise Unverified(f"{MANIFEST_FILE} is not a format-{FORMAT} record of step {step}")
        return m

    def _verify(self, step: int) -> None:
        """Full hash check, cached per manifest so retention stays cheap."""
        m = self._manifest(step)
        if self._verified.get(step) != m["sha256"]:
            try:
                size, sha = self._storage.hash_file(f"{self._dir(step)}/{STATE_FILE}")
            except FileNotFoundError:
                raise Unverified(f"no {STATE_FILE}") from None
            except OSError as exc:
                raise Unreadable(f"cannot read {STATE_FILE}: {exc}") from None
            verdicts.check_digest(STATE_FILE, m, size, sha)
            self._verified[step] = sha

    def _record_of(self, step: int, manifest: Mapping[str, Any]) -> dict[str, Any]:
        return {"url": self._storage.url(self._dir(step)), "step": step,
                "sha256": manifest["sha256"], "world_size": manifest.get("world_size")}

    # ---- hooks for the runtime ---------------------------------------------------------
    def _exit_line(self, error: BaseException) -> str:
        """The one line printed when a failed async save ends the process at exit."""
        return f"error: {error}"

    def _saved(self, step: int, url: str, duration_s: float) -> None:
        """Called once checkpoint `step` is verified and published (writer thread)."""

    # ---- writing -------------------------------------------------------------------------
    def _write(self, step: int, state: Any) -> None:
        started = time.monotonic()
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        sha = hashlib.sha256(data).hexdigest()
        self._check_fence(step, sha)
        self._claim.check_before_writing(step)
        record = self._record_of(step, self._commit(step, data, sha))
        if self._publish(record):
            self._saved(step, record["url"], round(time.monotonic() - started, 3))
            self._tidy(step)

    def _check_fence(self, step: int, sha: str) -> None:
        """Keep a writer already known to be stale from clobbering published files.

        publish() stays authoritative: the record can move after this read.
        """
        rec = self._latest.read() if self._latest is not None else None
        if refuses(rec, {"step": step, "sha256": sha}):
            raise self._stale(step)

    def _stale(self, step: int) -> StaleWriterError:
        root = self._storage.url(self._storage.root)
        return StaleWriterError(
            f"latest_store refused checkpoint step {step} under {root}: a newer step is "
            "recorded or this writer was fenced (its round is over). Stop this worker "
            "and let the launcher restart it.", step)

    def _commit(self, step: int, data: bytes, sha: str) -> dict[str, Any]:
        """Rewriting an unpublished step is allowed; the newest write wins."""
        d, st = self._dir(step), self._storage
        manifest: dict[str, Any] = self._claim.stamp({
            "format": FORMAT, "step": step, "sha256": sha, "bytes": len(data),
            "created": time.time()})
        if self._world_size is not None:
            manifest["world_size"] = self._world_size
        wrote_state, made_dir = False, not st.fs.exists(d)
        try:
            st.fs.makedirs(d, exist_ok=True)
            st.write_atomic(f"{d}/{STATE_FILE}", data)
            wrote_state = True
            st.write_atomic(f"{d}/{MANIFEST_FILE}", json.dumps(manifest, indent=1).encode())
            st.sync_dir(d)
            st.sync_dir(st.root)
        except OSError as exc:
            if wrote_state:
                st.discard(f"{d}/{STATE_FILE}")
            if made_dir:  # an empty directory would warn on every load
                st.discard(d, directory=True)
            raise CheckpointWriteError(
                f"could not write checkpoint step {step} ({st.url(d)}): {exc}. Earlier "
                f"checkpoints are intact; free space or fix permissions under "
                f"{st.url(st.root)} (or point the Checkpointer elsewhere) and save again."
            ) from exc
        self._verified.pop(step, None)
        try:
            self._verify(step)
        except Unverified as exc:
            raise CheckpointWriteError(f"read-back of {st.url(d)} failed: {exc}") from None
        return manifest

    def _publish(self, record: dict[str, Any]) -> bool:
        """True once recorded; False when the store is out (pending_record.py says why
        training goes on then, with nothing tidied)."""
        if self._latest is None:
            return True
        accepted = self._pending.publish(self._latest.publish, record)
        if accepted is False:
            raise self._stale(record["step"])  # the files stay, but are not the latest
        return bool(accepted)

    # ---- tidying (after a published save) ---------------------------------------------
    def _tidy(self, saved: int) -> None:
        verdicts.tidy(self._storage, self._dir, self._claim.protecting(self._verify),
                      self._remove, self.config.keep, saved)

    def _remove(self, step: int) -> None:
        d = self._dir(step)
        try:
            # Manifest first: a half-deleted directory then reads as uncommitted.
            try:
                self._storage.fs.rm_file(f"{d}/{MANIFEST_FILE}")
            except FileNotFoundError:
                pass
            self._storage.fs.rm(d, recursive=True)
        except OSError as exc:
            log.warning("could not remove checkpoint %s: %s", d, exc)
        self._verified.pop(step, None)


def _dist_rank_and_size() -> tuple[int, int | None]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, None
