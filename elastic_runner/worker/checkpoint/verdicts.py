"""Why a checkpoint directory is not loaded, and what tidying deletes: both formats.

A step directory is either verified (its manifest and every file it lists check out),
unverified (it must be skipped, and may be deleted once a newer save is published:
no manifest, a wrong size or sha256), unreadable (storage did not answer: maybe
transient, so never deleted), or of the other format (written with the other value
of `sharded`: neither loaded nor deleted).

After each published save of step S, the writer tidies the steps up to S: verified
ones beyond `keep` are deleted, directories below S that definitely do not verify are
deleted, and the temporary files of writers killed mid-write are deleted from the
directories kept. It never touches S itself (the newest verified step as far as this
writer knows), steps above S (they may be a newer writer's, or evidence of a
rollback), or a step it could not read. A fenced writer still writing a step below S
loses its files, which is the outcome it must have anyway: it can no longer publish.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from elastic_runner.errors import CheckpointError
from elastic_runner.worker.checkpoint.storage import Storage

log = logging.getLogger("elastic_runner.worker.checkpoint")

MANIFEST_FILE = "MANIFEST.json"


class Unverified(Exception):
    """A checkpoint that must be skipped; the message is the reason."""


class Unreadable(Unverified):
    """Skipped because storage did not answer; maybe transient, so never deleted."""


class OtherFormat(Unreadable):
    """Written with the other value of `sharded`: never loaded as this one, never deleted."""




def check_digest(name: str, manifest: Mapping[str, Any], size: int, sha: str) -> None:
    """Raise Unverified unless file `name` has the size and sha256 its manifest says."""
    if size != manifest["bytes"]:
        raise Unverified(f"{name} has {size} bytes, manifest says {manifest['bytes']}")
    if sha != manifest["sha256"]:
        raise Unverified(f"{name} sha256 {sha[:12]}... does not match the manifest")

def absent_recorded_step(storage: Storage, record: Mapping[str, Any],
                         ranks: str = "this rank") -> CheckpointError:
    """The error for a recorded step whose directory does not exist here at all.

    Why not skip it as rot (and retract the record, as for a flipped bit): a committed,
    recorded checkpoint that is missing entirely means this rank reads another folder
    than the writer wrote: a node-local path on a job of several nodes, or a changed
    --checkpoint-dir. Skipping it started that node from scratch while the writer's
    node resumed (ranks disagreeing on the step and the data position), and the
    retraction then unnamed a good checkpoint for everyone."""
    return CheckpointError(
        f"the checkpoint recorded for this run, step {record['step']} ({record.get('url')}), "
        f"is not in the checkpoint folder {storage.url(storage.root)} as {ranks} sees it: "
        "every node must read and write one folder (a network filesystem, or an object "
        "store URL such as s3://; a node-local path works on one node only), the one the "
        "run saved into. Nothing was retracted or deleted; if that checkpoint was removed "
        "on purpose, start the job under a new --run-id to resume from what the folder holds")


def unreadable_recorded_step(url: str, step: int, why: Exception) -> CheckpointError:
    """Why a recorded step storage did not answer for is not skipped: a passing error
    (a network filesystem's hiccup) must not retract a good record, nor let this rank
    resume from an older step than ranks that read it fine. The worker fails instead,
    and the restart reads again."""
    return CheckpointError(
        f"cannot read the checkpoint recorded for this run, step {step} ({url}): {why}. "
        "Nothing was retracted; if the storage error passes, the restart loads it")

def tidy(storage: Storage, directory_of: Callable[[int], str], verify: Callable[[int], object],
         remove: Callable[[int], None], keep: int | None, saved: int) -> None:
    """Delete what the save of `saved` made obsolete (the rules above). `verify(step)`
    raises Unverified, Unreadable or OtherFormat for a step that does not check out."""
    kept = 0
    try:
        for step in (s for s in storage.steps() if s <= saved):
            try:
                verify(step)
            except Unreadable:  # also the other format
                continue
            except Unverified as exc:
                if step < saved:
                    log.info("removing unverified checkpoint %s: %s",
                             storage.url(directory_of(step)), exc)
                    remove(step)
                continue
            kept += 1
            if keep is not None and kept > keep:
                remove(step)
            else:
                storage.remove_temporaries(directory_of(step))
    except OSError as exc:  # the save itself is done and published
        log.warning("could not tidy checkpoints under %s: %s", storage.url(storage.root), exc)
