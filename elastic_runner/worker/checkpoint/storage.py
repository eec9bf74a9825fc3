"""Durable writes for checkpoints on any fsspec filesystem.

Why separate: what makes a write durable differs per filesystem (fsync and an
atomic rename locally, a completed upload on object stores); the Checkpointer
only needs "write atomically", "list steps" and "hash a file".
"""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import Any, Mapping

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elastic_runner import files
from elastic_runner.errors import CheckpointError

STEP_DIR = re.compile(r"^step-(\d+)$")
TEMPORARY = files.TEMPORARY  # write_atomic's names, nothing else
CHUNK = files.CHUNK


def _write_all(fileobj: Any, data: bytes) -> None:
    """Every checkpoint byte goes through here, local or remote: one seam that the
    fault-injection tests wrap (a full disk, a writer killed half-way)."""
    files.write_chunks(fileobj, data)


def _check_location(url: str) -> None:
    """An empty location (an unset variable, say) would put checkpoints in whatever
    folder the worker started in; a control character would break every log line
    that names a checkpoint."""
    if not url.strip():
        raise CheckpointError("the checkpoint location is empty: give a folder or a URL "
                              "such as s3://bucket/run")
    if any(not char.isprintable() for char in url):
        raise CheckpointError(f"the checkpoint location {url!r} holds a control character "
                              "(a newline, say): give it without")


class Storage:
    """fsspec wrapper that knows how to make a write durable per filesystem."""

    def __init__(self, url: str, options: Mapping[str, Any]) -> None:
        _check_location(url)
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **options)
        except (ImportError, ValueError) as exc:
            raise CheckpointError(
                f"cannot open checkpoint location {url!r}: {exc}. Install the fsspec "
                "backend for its protocol (e.g. s3fs, gcsfs) or use a local path."
            ) from exc
        except OSError as exc:  # a backend that connects at once (ftp, sftp, hdfs)
            raise CheckpointError(f"cannot open checkpoint location {url!r}: {exc}") from exc
        self.root = root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)

    def url(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def write_atomic(self, path: str, data: bytes) -> None:
        """Readers see the old file or the whole new one, never a prefix.

        Locally: the shared durable write (fsync, rename, fsync of the directory).
        Elsewhere: upload to a temporary name, then move it; an upload only appears
        once complete, and the temporary's name is one remove_temporaries finds.
        """
        if self.local:
            files.write_atomic(path, data, durable=True, write=_write_all)
            return
        tmp = files.temporary_name(path)
        try:
            with self.fs.open(tmp, "wb") as f:
                _write_all(f, data)
            self.fs.mv(tmp, path)
        except BaseException:
            self.discard(tmp)
            raise

    def discard(self, path: str, directory: bool = False) -> None:
        """Best-effort cleanup that must never mask the error being raised."""
        try:
            self.fs.rmdir(path) if directory else self.fs.rm_file(path)
        except OSError:
            pass

    def remove_temporaries(self, directory: str) -> None:
        """Delete what writers killed mid-write left in `directory` (write_atomic's
        temporary names only). A writer still running there loses its rename and
        fails, which is right: the caller only tidies steps up to the one it has just
        published, so such a writer could not publish anyway."""
        self.fs.invalidate_cache(directory)
        try:
            paths = self.fs.ls(directory, detail=False)
        except OSError:
            return
        for path in paths:
            if TEMPORARY.search(path.rstrip("/")):
                self.discard(path)

    def sync_dir(self, path: str) -> None:
        """Make renames durable; only meaningful (and possible) locally."""
        if self.local:
            files.fsync_dir(path)

    def hash_file(self, path: str) -> tuple[int, str]:
        digest, size = hashlib.sha256(), 0
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
        return size, digest.hexdigest()

    def steps(self) -> list[int]:
        """Step numbers present, committed or not, newest first."""
        self.fs.invalidate_cache(self.root)  # other nodes write here too
        try:
            paths = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        names = (p.rstrip("/").rsplit("/", 1)[-1] for p in paths)
        return sorted({int(m.group(1)) for n in names if (m := STEP_DIR.match(n))}, reverse=True)

    def probe(self) -> None:
        """Fail at start-up rather than at the first save hours later."""
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            path = f"{self.root}/.write-probe-{uuid.uuid4().hex[:12]}"
            self.fs.pipe_file(path, b"ok")
            self.fs.rm_file(path)
        except OSError as exc:
            raise CheckpointError(
                f"rank 0 cannot write checkpoints to {self.url(self.root)}: {exc}. "
                "Fix its permissions or pass a writable location."
            ) from exc
