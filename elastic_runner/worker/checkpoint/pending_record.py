"""A checkpoint written and verified whose record the store could not take (yet).

Why training goes on: the record lives in etcd, and etcd can refuse every write for
a while (its space quota used up, the NOSPACE alarm) or stop answering, while the
checkpoint's files are durable and the job still trains. Ending the worker for it
turned an operator's chore into a stopped job: the agent could not even record the
failure, so every node waited for the fix. Now the save is kept on storage, the
record goes on naming the last step it took (which is what a restart resumes from,
since unrecorded files are never trusted: checkpointer.load_latest), tidying is held
back so that step survives, and the next save records again.

Why the last one must still fail loudly: a job that ends with its newest checkpoint
unrecorded would resume, next time, from an older one without a word. So close()
offers the record once more and raises if the store still cannot take it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from elastic_runner.errors import CheckpointError, EtcdUnavailable

log = logging.getLogger("elastic_runner.worker.checkpoint")


class PendingRecord:
    """The newest unrecorded save of one writer (rank 0), and how it is offered again."""

    def __init__(self) -> None:
        self.record: dict[str, Any] | None = None

    def publish(self, publish: Callable[[dict[str, Any]], bool],
                record: dict[str, Any]) -> bool | None:
        """`publish(record)`'s answer (True taken, False refused), or None when the
        store could not answer for an outage: the record is then held as pending."""
        try:
            accepted = publish(record)
        except EtcdUnavailable as error:
            self._missed(record, error)
            return None
        if accepted and self.record is not None:
            log.warning("checkpoint step %d recorded: the record store takes writes again "
                        "(step %d, the newest it missed, is superseded)", record["step"],
                        self.record["step"])
            self.record = None
        return accepted

    def offer_last(self, publish: Callable[[dict[str, Any]], bool]) -> bool:
        """At close: record the pending save now, or raise. False: the store refused it
        (a newer step is recorded, or this writer's round is over)."""
        if self.record is None:
            return True
        record = self.record
        try:
            accepted = publish(record)
        except EtcdUnavailable as error:
            raise CheckpointError(
                f"the last checkpoint, step {record['step']} ({record['url']}), is written "
                f"and verified but was never recorded: {error}. A restart would resume from "
                "the step the record names; once etcd takes writes again the job's next "
                "save records it") from error
        if accepted:
            log.warning("checkpoint step %d recorded at close", record["step"])
            self.record = None
        return accepted

    def _missed(self, record: dict[str, Any], error: EtcdUnavailable) -> None:
        first = self.record is None
        self.record = record
        (log.warning if first else log.info)(
            "checkpoint step %d is written and verified (%s) but not recorded: %s. Training "
            "goes on; until a save is recorded a restart resumes from the step the record "
            "names, and older checkpoints are kept", record["step"], record["url"], error)
