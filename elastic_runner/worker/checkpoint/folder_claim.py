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

A run id alone does not tell two launches apart: the default one is the script and its
arguments, so the same command started on two nodes that each run their own etcd (one
started without --rdzv-endpoints embeds one) is two jobs under one id. Manifests also carry the
run's *origin*, a random token its first agent wrote beside the spec
(rendezvous/protocol.origin_key): a step of the same run id from another origin is
another writer's. A manifest without one (an older release's) matches any origin.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from elastic_runner.errors import CheckpointError
from elastic_runner.worker.checkpoint.storage import Storage
from elastic_runner.worker.checkpoint.verdicts import MANIFEST_FILE, Unreadable

MANIFEST_RUN, MANIFEST_ORIGIN = "run_id", "run_origin"


@dataclass(frozen=True)
class RunIdentity:
    """Who wrote a step: the run id, and which launch of it (None: not said)."""

    run_id: str
    origin: str | None = None

    def same_writer(self, other: "RunIdentity") -> bool:
        return self.run_id == other.run_id and (
            self.origin is None or other.origin is None or self.origin == other.origin)

    def describe(self) -> str:
        return repr(self.run_id) if self.origin is None else \
            f"{self.run_id!r} (origin {self.origin})"


class AnotherRuns(Unreadable):
    """A step of another run, newer than what this run's load examined: never deleted."""


class FolderClaim:
    """One writer's view of whose steps are in its folder."""

    def __init__(self, storage: Storage, run_id: str | None,
                 directory_of: Callable[[int], str], origin: str | None = None) -> None:
        self._storage, self._directory_of = storage, directory_of
        self.me = RunIdentity(run_id, origin or None) if run_id is not None else None
        self.adopted: int | None = None  # the newest step the last load examined

    def loading(self) -> None:
        self.adopted = None

    def examined(self, step: int) -> None:
        self.adopted = step if self.adopted is None else max(self.adopted, step)

    def stamp(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """`manifest`, naming this run and its origin where known."""
        if self.me is not None:
            manifest[MANIFEST_RUN] = self.me.run_id
            if self.me.origin is not None:
                manifest[MANIFEST_ORIGIN] = self.me.origin
        return manifest

    def check_before_writing(self, step: int) -> None:
        """Raise CheckpointError if another run wrote here past what this one's load saw.

        The step to write first (never overwrite another run's), then newest first up
        to this run's own newest step: a second writer whose steps lie below it is
        behind, and is the one refused (it meets ours), so a save reads a manifest or
        three, not the folder."""
        if self.me is None:
            return
        for other in [step, *self._storage.steps()]:
            if self.adopted is not None and other <= self.adopted:
                if other != step:
                    return  # the history this run resumed from
                continue
            owner = self._owner(other)
            if owner is None:
                continue
            if not owner.same_writer(self.me):
                raise self._clash(other, owner, step)
            if other != step:
                return

    def _clash(self, other: int, owner: RunIdentity, step: int) -> CheckpointError:
        """Origins are named only where the run ids agree (then they are the news)."""
        same_id = owner.run_id == self.me.run_id
        me, them = (self.me.describe(), owner.describe()) if same_id else \
            (repr(self.me.run_id), repr(owner.run_id))
        seen = (f"step {self.adopted}, the newest this run ({me}) examined when it loaded"
                if self.adopted is not None else f"any step this run ({me}) loaded")
        head = (f"checkpoint folder {self._storage.url(self._storage.root)} holds step "
                f"{other} of run {them}, newer than {seen}")
        if not same_id:
            return CheckpointError(
                f"{head}. Two runs saving into one folder overwrite and delete each other's "
                f"checkpoints, so step {step} is not written: give each run its own checkpoint "
                "folder (to continue an ended run, start the new one by loading its "
                "checkpoints)")
        return CheckpointError(
            f"{head}: one run id launched twice against two etcds (a node started without "
            "--rdzv-endpoints runs an etcd of its own). Two launches saving into one folder "
            f"overwrite and delete each other's checkpoints, so step {step} is not written: "
            "start every node with the same --rdzv-endpoints, or give each launch its own "
            "checkpoint folder and run id")

    def protecting(self, verify: Callable[[int], object]) -> Callable[[int], object]:
        """`verify` for tidying, raising AnotherRuns for a step it must keep (asked
        first: another run's step that does not verify now may be one it is rewriting)."""
        def checked(step: int) -> object:
            if self.me is not None and (self.adopted is None or step > self.adopted):
                owner = self._owner(step)
                if owner is not None and not owner.same_writer(self.me):
                    raise AnotherRuns(f"step {step} is run {owner.describe()}'s")
            return verify(step)
        return checked

    def _owner(self, step: int) -> RunIdentity | None:
        """The run its manifest names, in either format; None: nobody's, or no usable
        manifest (a save cut short is no evidence of a writer)."""
        try:
            manifest = json.loads(self._storage.fs.cat_file(
                f"{self._directory_of(step)}/{MANIFEST_FILE}"))
        except (OSError, ValueError):
            return None
        if not isinstance(manifest, dict) or not isinstance(manifest.get(MANIFEST_RUN), str):
            return None
        origin = manifest.get(MANIFEST_ORIGIN)
        return RunIdentity(manifest[MANIFEST_RUN], origin if isinstance(origin, str) else None)
