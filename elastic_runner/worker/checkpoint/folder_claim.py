"""Two runs saving into one checkpoint folder: refused before either loses a checkpoint.

Why: a folder is easy to share by accident (a script's default `--checkpoint-dir`, a
command copied with a new `--run-id`). Each run's record fences only that run, so
without this its writer would overwrite the other's step directories (a step the
other run recorded then fails its sha256 check and that run falls back) and its
tidying would delete the other's checkpoints as if they were its own old ones.

The rule, per step directory, from the run id its manifest names (manifests written
outside elastic-run, or before this rule, name none and belong to nobody):
- a run *adopts* the steps its load examined, up to the newest (the one it resumed
  from, or a newer one it skipped as corrupt): resuming from a finished or failed run's
  checkpoints under a new run id is how a job is continued, and its tidying then
  cleans them up as its own;
- another run's step above that is evidence of a second writer here now: the save is
  refused with one line, before anything is written, and tidying never deletes it.
"""

from __future__ import annotations

import json
from typing import Callable

from elastic_runner.errors import CheckpointError
from elastic_runner.worker.checkpoint.storage import Storage
from elastic_runner.worker.checkpoint.verdicts import MANIFEST_FILE, Unreadable

MANIFEST_RUN = "run_id"


class AnotherRuns(Unreadable):
    """A step of another run, newer than what this run's load examined: never deleted."""


class FolderClaim:
    """One writer's view of whose steps are in its folder."""

    def __init__(self, storage: Storage, run_id: str | None,
                 directory_of: Callable[[int], str]) -> None:
        self._storage, self.run_id, self._directory_of = storage, run_id, directory_of
        self.adopted: int | None = None  # the newest step the last load examined

    def loading(self) -> None:
        self.adopted = None

    def examined(self, step: int) -> None:
        self.adopted = step if self.adopted is None else max(self.adopted, step)

    def check_before_writing(self, step: int) -> None:
        """Raise CheckpointError if another run wrote here past what this one's load saw.

        The step to write first (never overwrite another run's), then newest first up
        to this run's own newest step: a second writer whose steps lie below it is
        behind, and is the one refused (it meets ours), so a save reads a manifest or
        three, not the folder."""
        if self.run_id is None:
            return
        for other in [step, *self._storage.steps()]:
            if self.adopted is not None and other <= self.adopted:
                if other != step:
                    return  # the history this run resumed from
                continue
            owner = self._owner(other)
            if owner == self.run_id and other != step:
                return
            if owner is not None and owner != self.run_id:
                raise self._clash(other, owner, step)

    def _clash(self, other: int, owner: str, step: int) -> CheckpointError:
        seen = (f"step {self.adopted}, the newest this run ({self.run_id!r}) examined when it "
                "loaded" if self.adopted is not None else
                f"any step this run ({self.run_id!r}) loaded")
        return CheckpointError(
            f"checkpoint folder {self._storage.url(self._storage.root)} holds step {other} of "
            f"run {owner!r}, newer than {seen}. Two runs saving into one folder overwrite and "
            f"delete each other's checkpoints, so step {step} is not written: give each run "
            "its own checkpoint folder (to continue an ended run, start the new one by "
            "loading its checkpoints)")

    def protecting(self, verify: Callable[[int], object]) -> Callable[[int], object]:
        """`verify` for tidying, raising AnotherRuns for a step it must keep (asked
        first: another run's step that does not verify now may be one it is rewriting)."""
        def checked(step: int) -> object:
            if self.run_id is not None and (self.adopted is None or step > self.adopted):
                owner = self._owner(step)
                if owner is not None and owner != self.run_id:
                    raise AnotherRuns(f"step {step} is run {owner!r}'s")
            return verify(step)
        return checked

    def _owner(self, step: int) -> str | None:
        """The run its manifest names, in either format; None: nobody's, or no usable
        manifest (a save cut short is no evidence of a writer)."""
        try:
            manifest = json.loads(self._storage.fs.cat_file(
                f"{self._directory_of(step)}/{MANIFEST_FILE}"))
        except (OSError, ValueError):
            return None
        owner = manifest.get(MANIFEST_RUN) if isinstance(manifest, dict) else None
        return owner if isinstance(owner, str) else None
