"""Atomic replacement of a local file: readers see the old content or the new, never a prefix.

Why one helper: the worker's progress file, rank 0's checkpoint record for the metrics
and the local checkpoint store all publish a file that another process may read at any
moment, and a writer may be killed mid-write (a spot node, SIGKILL after the stop grace).
The recipe is the same each time: write a temporary file in the same directory (so the
rename cannot cross a filesystem), `os.replace` it over the target (atomic on POSIX),
and remove the temporary if anything fails before the rename.

`durable=True` adds what makes the new content survive a power loss once the call
returns: fsync the file before the rename, and the directory after it (the rename lives
in the directory). Progress and metrics files skip both: they are rewritten every half
second and an fsync there would cost every training step.

Torch-free and without project imports: the agent, the workers and the checkpoint
store all use it. Errors are the OSError of the failing call: each caller knows whether
a failed write is fatal (a checkpoint) or advisory (progress for the metrics).
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from typing import Any, Callable

log = logging.getLogger("elastic_runner.files")

# The temporary names write_atomic uses, so a cleanup can find those a killed writer left.
TEMPORARY = re.compile(r"\.tmp-[0-9a-f]{12}$")
CHUNK = 8 << 20


def temporary_name(path: str | os.PathLike[str]) -> str:
    """A fresh name next to `path` that TEMPORARY matches (unique per call and thread)."""
    return f"{os.fspath(path)}.tmp-{uuid.uuid4().hex[:12]}"


def write_chunks(fileobj: Any, data: bytes) -> None:
    """Write in slices of a memoryview: a huge payload needs no second in-memory copy."""
    view = memoryview(data)
    for start in range(0, len(view), CHUNK):
        fileobj.write(view[start:start + CHUNK])


def write_atomic(path: str | os.PathLike[str], data: bytes, *, durable: bool,
                 write: Callable[[Any, bytes], None] = write_chunks) -> None:
    """Replace `path` with `data` atomically; with `durable`, also fsync file and directory.

    On any failure (including KeyboardInterrupt) the temporary is removed and `path`
    keeps its old content; the exception propagates. `write` puts the bytes into the
    open temporary (the checkpoint store passes its own seam, which tests wrap to
    fill a disk or hang mid-write).
    """
    target = os.fspath(path)
    temporary = temporary_name(target)
    try:
        with open(temporary, "xb") as handle:
            write(handle, data)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        _remove_quietly(temporary)
        raise
    if durable:
        fsync_dir(os.path.dirname(target) or ".")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the renames and creations in directory `path` durable.

    Best effort on purpose: some filesystems (network, FUSE) refuse fsync on a
    directory. The rename has happened by then, so the write is still atomic; only its
    survival across a power loss is up to that filesystem.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        log.debug("fsync of directory %s failed: %s", path, exc)


def _remove_quietly(path: str) -> None:
    """Cleanup that must never mask the error being raised."""
    try:
        os.unlink(path)
    except OSError:
        pass
