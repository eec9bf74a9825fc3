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
from typing import Callable

from elastic_runner.worker.checkpoint.storage import Storage

log = logging.getLogger("elastic_runner.worker.checkpoint")

MANIFEST_FILE = "MANIFEST.json"


class Unverified(Exception):
    """A checkpoint that must be skipped; the message is the reason."""


class Unreadable(Unverified):
    """Skipped because storage did not answer; maybe transient, so never deleted."""


class OtherFormat(Unreadable):
    """Written with the other value of `sharded`: never loaded as this one, never deleted."""


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
