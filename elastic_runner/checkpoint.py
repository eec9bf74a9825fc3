"""Crash-safe, fenced checkpoints for elastic training.

Every restart resumes from what rank 0 last committed, so a checkpoint must be
complete and verified or ignored, and a writer whose round is over must not
replace a newer record. Payloads are hashed, written under temporary names,
renamed into place and committed by writing MANIFEST.json last::

    <root>/step-00000123/state.pt        torch.save bytes
    <root>/step-00000123/MANIFEST.json   {"format": 1, "step", "sha256", "bytes",
                                          "created", "world_size" (when known)}

Every rank's `load_latest()` reads the same root (and `latest_store`), so all
ranks resolve the same step as long as no save is in flight: saves happen during
training, loads at start. Unverified directories are never deleted; they stay
for inspection.
"""

from __future__ import annotations

import concurrent.futures as futures
import copy
import hashlib
import io
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from elastic_runner.checkpoint_storage import Storage as _Storage
from elastic_runner.errors import CheckpointError, CheckpointWriteError, StaleWriterError

__all__ = [
    "CheckpointConfig", "CheckpointError", "CheckpointWriteError", "Checkpointer",
    "LatestStore", "MemoryLatestStore", "StaleWriterError",
]

log = logging.getLogger("elastic_runner.checkpoint")

FORMAT = 1
STATE_FILE = "state.pt"
MANIFEST_FILE = "MANIFEST.json"
_SKIPPED = object()


class _Unverified(Exception):
    """A checkpoint that must be skipped; the message is the reason."""


@runtime_checkable
class LatestStore(Protocol):
    """Compare-and-swap record of the newest verified checkpoint (e.g. in etcd).

    It lives outside the checkpoint storage so that a fenced writer, which can
    still write files, cannot make its files the ones everybody resumes from.
    """

    def read(self) -> dict[str, Any] | None: ...

    def publish(self, record: dict[str, Any]) -> bool: ...


class MemoryLatestStore:
    """In-process `LatestStore` for tests and single-node runs.

    Refuses a lower step, and an equal step with another sha256 (two writers
    disagree about one step); the identical record is accepted again so a
    retried save is idempotent.
    """

    def __init__(self, record: Mapping[str, Any] | None = None) -> None:
        self._lock = threading.Lock()
        self._record = dict(record) if record is not None else None

    def read(self) -> dict[str, Any] | None:
        with self._lock:
            return None if self._record is None else dict(self._record)

    def publish(self, record: dict[str, Any]) -> bool:
        with self._lock:
            cur = self._record
            if cur is not None and (
                record["step"] < cur["step"]
                or (record["step"] == cur["step"] and record["sha256"] != cur["sha256"])
            ):
                return False
            self._record = dict(record)
            return True


@dataclass(frozen=True)
class CheckpointConfig:
    """Policy knobs, validated once so a bad value fails at construction."""

    keep: int | None = 3
    every: int | None = None
    async_save: bool = False
    weights_only: bool = True

    def __post_init__(self) -> None:
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"keep must be >= 1 or None (keep all), got {self.keep}")
        if self.every is not None and self.every < 1:
            raise ValueError(f"every must be >= 1 or None, got {self.every}")


class Checkpointer:
    """Rank-0 writer and all-rank reader of verified checkpoints.

    Use it from the training thread only; its one background thread
    (async_save) is internal.
    """

    def __init__(self, url_or_path: str | os.PathLike[str], keep: int | None = 3,
                 every: int | None = None, async_save: bool = False, rank: int | None = None,
                 latest_store: LatestStore | None = None, *, weights_only: bool = True,
                 world_size: int | None = None,
                 storage_options: Mapping[str, Any] | None = None) -> None:
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

        Raises:
            CheckpointError: rank 0 cannot write to the root, or no fsspec backend.
        """
        self.config = CheckpointConfig(keep, every, async_save, weights_only)
        dist_rank, dist_world = _dist_rank_and_size()
        self.rank = dist_rank if rank is None else rank
        self._world_size = dist_world if world_size is None else world_size
        self._storage = _Storage(os.fspath(url_or_path), storage_options or {})
        self._latest = latest_store
        self._requested = threading.Event()
        self._verified: dict[int, str] = {}  # step -> sha256 already hashed
        self._future: futures.Future[None] | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self.loaded_step: int | None = None
        self._closed = False
        if self.rank == 0:
            self._storage.probe()
            if async_save:
                self._executor = futures.ThreadPoolExecutor(1, "ckpt-writer")

    def due(self, step: int) -> bool:
        """Stays True after request_save() until a save happens, so none is lost."""
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
            CheckpointError: raised by the previous async save, reported here.
        """
        if self.rank != 0:
            self._requested.clear()
            return None
        if self._closed:
            raise CheckpointError("save() on a closed Checkpointer")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._collect()
        if self._executor is None:
            self._write(step, state_dict)
        else:
            snapshot = _snapshot(state_dict, {})
            self._future = self._executor.submit(self._write, step, snapshot)
        self._requested.clear()
        return self._storage.url(self._dir(step))

    def wait(self) -> None:
        """Block until the in-flight async save is done; re-raise its error."""
        self._collect()

    def close(self) -> None:
        """Finish the in-flight save so a clean exit never loses the last one."""
        if self._closed:
            return
        self._closed = True
        try:
            self._collect()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def load_latest(self) -> Any:
        """Payload of the newest verified checkpoint, or None if there is none.

        A store record wins over the directory scan, because newer files were
        never published (crash before publish, or a fenced writer); if the
        record does not verify, only older steps are scanned. Corrupt and
        uncommitted checkpoints are skipped with one warning each, never deleted.

        Raises:
            CheckpointError: a checkpoint passed its sha256 check but torch.load
                refused it (e.g. custom classes with weights_only=True). Falling
                back would silently throw away training progress.
        """
        if self._future is not None:  # our own save; its error stays for wait()
            futures.wait([self._future])
        below = None
        record = self._latest.read() if self._latest is not None else None
        if record is not None:
            below = int(record["step"])
            state = self._try_load(below, expect_sha=record.get("sha256"))
            if state is not _SKIPPED:
                return state
        for step in self._storage.steps():
            if below is None or step < below:
                state = self._try_load(step)
                if state is not _SKIPPED:
                    return state
        return None

    def _dir(self, step: int) -> str:
        return f"{self._storage.root}/step-{step:08d}"

    def _collect(self) -> None:
        fut = self._future
        try:
            if fut is not None:
                fut.result()
        finally:
            if fut is not None and fut.done():
                self._future = None

    def _try_load(self, step: int, expect_sha: str | None = None) -> Any:
        path = self._dir(step)
        try:
            manifest = self._manifest(step)
            if expect_sha is not None and manifest["sha256"] != expect_sha:
                raise _Unverified("its sha256 differs from the latest_store record")
            try:
                data = self._storage.fs.cat_file(f"{path}/{STATE_FILE}")
            except OSError as exc:
                raise _Unverified(f"cannot read {STATE_FILE}: {exc}") from None
            _check_digest(manifest, len(data), hashlib.sha256(data).hexdigest())
        except _Unverified as exc:
            log.warning("skipping checkpoint %s: %s", self._storage.url(path), exc)
            return _SKIPPED
        self._verified[step] = manifest["sha256"]
        state = self._deserialize(data, path)
        self.loaded_step = step
        return state

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
            raise _Unverified(f"no {MANIFEST_FILE}: the save never committed") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise _Unverified(f"unreadable {MANIFEST_FILE}: {exc!r}") from None
        if not ok:
            raise _Unverified(f"{MANIFEST_FILE} is not a format-{FORMAT} record of step {step}")
        return m

    def _verify(self, step: int) -> None:
        """Full hash check, cached per manifest so retention stays cheap."""
        m = self._manifest(step)
        if self._verified.get(step) != m["sha256"]:
            try:
                size, sha = self._storage.hash_file(f"{self._dir(step)}/{STATE_FILE}")
            except OSError as exc:
                raise _Unverified(f"cannot read {STATE_FILE}: {exc}") from None
            _check_digest(m, size, sha)
            self._verified[step] = sha

    def _write(self, step: int, state: Any) -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        sha = hashlib.sha256(data).hexdigest()
        self._check_fence(step, sha)
        self._publish(self._commit(step, data, sha))
        self._prune(step)

    def _check_fence(self, step: int, sha: str) -> None:
        """Keep a writer already known to be stale from clobbering published files.

        publish() stays authoritative: the record can move after this read.
        """
        rec = self._latest.read() if self._latest is not None else None
        if rec and (rec["step"] > step or (rec["step"] == step and rec["sha256"] != sha)):
            raise self._stale(step)

    def _stale(self, step: int) -> StaleWriterError:
        root = self._storage.url(self._storage.root)
        return StaleWriterError(
            f"latest_store refused checkpoint step {step} under {root}: a newer step is "
            "recorded or this writer was fenced (its round is over). Stop this worker "
            "and let the launcher restart it."
        )

    def _commit(self, step: int, data: bytes, sha: str) -> dict[str, Any]:
        """Rewriting an unpublished step is allowed; the newest write wins."""
        d, st = self._dir(step), self._storage
        manifest: dict[str, Any] = {"format": FORMAT, "step": step, "sha256": sha,
                                    "bytes": len(data), "created": time.time()}
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
                f"could not write checkpoint {st.url(d)}: {exc}. Earlier checkpoints "
                f"are intact; free space or fix permissions under {st.url(st.root)} "
                "(or point the Checkpointer elsewhere) and save again."
            ) from exc
        self._verified.pop(step, None)
        try:
            self._verify(step)
        except _Unverified as exc:
            raise CheckpointWriteError(f"read-back of {st.url(d)} failed: {exc}") from None
        return manifest

    def _publish(self, manifest: dict[str, Any]) -> None:
        if self._latest is None:
            return
        step = manifest["step"]
        record = {"url": self._storage.url(self._dir(step)), "step": step,
                  "sha256": manifest["sha256"], "world_size": manifest.get("world_size")}
        if not self._latest.publish(record):
            raise self._stale(step)  # the files stay, but are not the latest

    def _prune(self, step: int) -> None:
        """Keep `keep` verified steps counting this one; delete older verified only."""
        if self.config.keep is None:
            return
        kept = 1
        for old in (s for s in self._storage.steps() if s < step):
            try:
                self._verify(old)
            except _Unverified:
                continue
            if kept < self.config.keep:
                kept += 1
            else:
                self._remove(old)

    def _remove(self, step: int) -> None:
        d = self._dir(step)
        try:
            # Manifest first: a half-deleted directory then reads as uncommitted.
            self._storage.fs.rm_file(f"{d}/{MANIFEST_FILE}")
            self._storage.fs.rm(d, recursive=True)
        except OSError as exc:
            log.warning("could not remove old checkpoint %s: %s", d, exc)
        self._verified.pop(step, None)


def _check_digest(manifest: Mapping[str, Any], size: int, sha: str) -> None:
    if size != manifest["bytes"]:
        raise _Unverified(f"{STATE_FILE} has {size} bytes, manifest says {manifest['bytes']}")
    if sha != manifest["sha256"]:
        raise _Unverified(f"{STATE_FILE} sha256 {sha[:12]}... does not match the manifest")


def _snapshot(obj: Any, memo: dict[int, torch.Tensor]) -> Any:
    """CPU copy made in the caller's thread so training may mutate right after."""
    # memo: a tensor that appears twice (tied weights) stays shared in the copy.
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = obj.detach().to("cpu", copy=True)
        return memo[id(obj)]
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, _snapshot(v, memo)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_snapshot(v, memo) for v in obj)
    return copy.deepcopy(obj)


def _dist_rank_and_size() -> tuple[int, int | None]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, None
