"""The files of a sharded checkpoint: who wrote which, their manifest, their checks.

On disk, one directory per step, next to those of the rank-0 format::

    <root>/step-00000200/__0_0.distcp     rank 0's shards (torch.distributed.checkpoint)
    <root>/step-00000200/__1_0.distcp     rank 1's shards, ...
    <root>/step-00000200/.metadata        DCP's index of every shard (written by rank 0)
    <root>/step-00000200/MANIFEST.json    written LAST, by rank 0, once every rank has
                                          hashed what it wrote

    MANIFEST.json = {"format": "sharded", "version": 1, "step": 200, "world_size": 4,
                     "created": <unix time>, "sha256": <digest of "files">,
                     "files": {"__0_0.distcp": {"bytes": n, "sha256": h, "rank": 0}, ...}}

Why a manifest of our own when DCP writes `.metadata`: DCP's index says where each
shard lies, not whether the bytes are still the ones written, and it is written before
every rank is known to have finished. The manifest's "sha256" (a digest of the file
table) is what the latest record carries, so two writers of one step that disagree
are told apart exactly as in the rank-0 format.

Which files a rank wrote is taken from DCP's own answer (`StorageWriter.write_data`
returns each WriteResult's `storage_data.relative_path`; `finish` runs on the
coordinator, which writes `.metadata`), not guessed from file names.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Mapping

from torch.distributed.checkpoint import FileSystemWriter, FileSystemReader

from elastic_runner.worker.checkpoint.verdicts import (  # noqa: F401 - sharded.py reads them here
    MANIFEST_FILE, OtherFormat, Unreadable, Unverified,
)

FORMAT = "sharded"
VERSION = 1
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint.filesystem's _metadata_fn


class _Recording:
    """Remembers the files this rank's DCP writer produced (see the module docstring)."""

    written: tuple[str, ...] = ()

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        # FileSystemWriter returns a completed torch.futures.Future (torch 2.13).
        results = future.wait()
        self.written = tuple(sorted({r.storage_data.relative_path for r in results}))
        return future

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self.written = tuple(sorted({*self.written, DCP_METADATA}))


class _LocalWriter(_Recording, FileSystemWriter):
    pass


def writer_for(storage: Any, directory: str, options: Mapping[str, Any]) -> Any:
    """A DCP writer into `directory` that fsyncs every shard (sync_files) and records
    what it wrote. Local paths: FileSystemWriter; other fsspec URLs: FsspecWriter."""
    if storage.local:
        return _LocalWriter(directory, sync_files=True)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    class _RemoteWriter(_Recording, FsspecWriter):
        pass

    return _RemoteWriter(storage.url(directory), sync_files=True, **options)


def reader_for(storage: Any, directory: str, options: Mapping[str, Any]) -> Any:
    if storage.local:
        return FileSystemReader(directory)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(storage.url(directory), **options)


def table_digest(files: Mapping[str, Mapping[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def build_manifest(step: int, world_size: int, files: Mapping[str, Mapping[str, Any]]
                   ) -> dict[str, Any]:
    """The run's identity is added by folder_claim.FolderClaim.stamp."""
    return {"format": FORMAT, "version": VERSION, "step": step, "world_size": world_size,
            "created": time.time(), "sha256": table_digest(files), "files": dict(files)}


def read_manifest(storage: Any, directory: str, step: int) -> dict[str, Any]:
    """The manifest of `step`, checked for shape and self-consistency.

    Raises:
        OtherFormat: a rank-0 checkpoint (format 1) is there.
        Unverified / Unreadable: no usable manifest (the save never committed).
    """
    try:
        m = json.loads(storage.fs.cat_file(f"{directory}/{MANIFEST_FILE}"))
        fmt = m.get("format")
        if fmt != FORMAT:
            raise OtherFormat(f"{storage.url(directory)} was saved with sharded=False "
                              f"(format {fmt!r})")
        ok = m["version"] == VERSION and m["step"] == step and isinstance(m["files"], dict)
        ok = ok and all(isinstance(e["bytes"], int) and isinstance(e["sha256"], str)
                        for e in m["files"].values())
        ok = ok and DCP_METADATA in m["files"] and m["sha256"] == table_digest(m["files"])
    except FileNotFoundError:
        raise Unverified(f"no {MANIFEST_FILE}: the save never committed") from None
    except OSError as exc:
        raise Unreadable(f"cannot read {MANIFEST_FILE}: {exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise Unverified(f"unreadable {MANIFEST_FILE}: {exc!r}") from None
    if not ok:
        raise Unverified(f"{MANIFEST_FILE} is not a consistent sharded record of step {step}")
    return m


def hash_files(storage: Any, directory: str, names: list[str] | tuple[str, ...],
               rank: int) -> dict[str, dict[str, Any]]:
    """(bytes, sha256) of the files this rank wrote, read back from storage."""
    table = {}
    for name in names:
        size, sha = storage.hash_file(f"{directory}/{name}")
        table[name] = {"bytes": size, "sha256": sha, "rank": rank}
    return table


def check_file(storage: Any, directory: str, name: str, entry: Mapping[str, Any]) -> None:
    """Raise Unverified naming `name` unless its bytes are the ones the manifest lists."""
    try:
        size, sha = storage.hash_file(f"{directory}/{name}")
    except FileNotFoundError:
        raise Unverified(f"{name} is missing") from None
    except OSError as exc:
        raise Unreadable(f"cannot read {name}: {exc}") from None
    if size != entry["bytes"]:
        raise Unverified(f"{name} has {size} bytes, the manifest says {entry['bytes']}")
    if sha != entry["sha256"]:
        raise Unverified(f"{name} sha256 {sha[:12]}... does not match the manifest")


def check_sizes(storage: Any, directory: str, manifest: Mapping[str, Any]) -> None:
    """The cheap check used for retention: every listed file is there with its size."""
    storage.fs.invalidate_cache(directory)
    try:
        listing = storage.fs.ls(directory, detail=True)
    except OSError as exc:
        raise Unreadable(f"cannot list {directory}: {exc}") from None
    sizes = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size") for e in listing}
    for name, entry in manifest["files"].items():
        if sizes.get(name) != entry["bytes"]:
            raise Unverified(f"{name} is missing or has the wrong size")
