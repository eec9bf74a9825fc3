"""The local channel between an agent and its workers for in-process re-formation.

Why files: the agent already talks to its workers through its private scratch folder
(contract.py), a worker must not hold an etcd client on its hot path, and a file
survives either side being slow. One folder per agent (`WorkerEnv.reform_dir`); every
write is atomic (readers see the old record or the new, never half); reading is a stat
and a small JSON parse, cheap enough to poll every few milliseconds while paused.

The conversation, one round at a time:

1. A worker written with `@er.elastic` reports `WorkerState(phase=TRAINING, round=r)`
   once its process group for round r is formed. That first report is how the agent
   learns that this worker can re-form in place; a worker that never reports keeps
   the restart path.
2. To re-form, the agent asks `ask_pause(r)`. Every rank agrees at the step boundary
   (the same MAX all-reduce as a spot notice), leaves round r's process group and
   reports `PAUSED` with the step it completed. A worker whose collective failed (a
   peer died) reports `PAUSED` with `reason` starting with `COLLECTIVE_ERROR`, without
   being asked: to the agent that is evidence that a member is gone.
3. Once round r+1 closes, the agent writes one `Assignment` per local worker (new
   rank, world size, store address) or `Assignment(leave=True)` when this node is not
   in it. The worker re-initialises, reports `TRAINING` for r+1, synchronises state and
   calls the training function again.
4. A worker that cannot re-form reports `FAILED` (and exits); the agent then falls
   back to the restart path for that round.

A node that joins a job whose workers re-form in place starts its workers *before*
it announces itself (agent/standby.py): they run the script up to the training
function (import torch, build the model, restore) with no place yet, report
`STANDBY` for round `STANDBY_ROUND`, and wait for an Assignment like a paused worker.
Only then does the node join, so the others pause for the process group and the state
transfer only, never for a Python start.

A worker whose script called `er.init(defer_group=True)` takes the same road while its
node is already a member: `er.init()` forms no group and reports `DEFERRED` for
`STANDBY_ROUND` (it will wait for a place, so the agent may follow membership changes
instead of restarting it), then `STANDBY` once it reaches its training function; the
agent gives it its place in the round current then (agent/deferred.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from elastic_runner.files import write_atomic

REFORM_DIR = "reform"  # in the agent's scratch folder

TRAINING = "training"  # in round `round`'s process group
PAUSED = "paused"  # left round `round`'s process group, waiting for an Assignment
FAILED = "failed"  # could not re-form; about to exit
STANDBY = "standby"  # started before its node joined: ready, waiting for a first place
DEFERRED = "deferred"  # er.init(defer_group=True): no group yet, STANDBY once ready
PHASES = (TRAINING, PAUSED, FAILED, STANDBY, DEFERRED)
STANDBY_ROUND = -1  # the round a standby worker reports (any real round is later)

ASKED = "asked"  # PAUSED because the agent asked (ask_pause)
COLLECTIVE_ERROR = "collective-error"  # PAUSED because a collective failed: "collective-error: <text>"


@dataclass(frozen=True)
class Assignment:
    """Agent -> one worker: its place in the next round (the torchrun variables that change)."""

    round: int
    rank: int = 0
    world_size: int = 0
    local_world_size: int = 0
    group_rank: int = 0
    group_world_size: int = 0
    master_addr: str = ""
    master_port: int = 0
    restart_count: int = 0
    leave: bool = False  # this node is not in round `round`: finish and exit


@dataclass(frozen=True)
class WorkerState:
    """One worker -> its agent: where it is."""

    round: int
    phase: str
    step: int  # the last step this rank completed (-1: none yet)
    pid: int
    reason: str = ""

    @property
    def saw_collective_error(self) -> bool:
        return self.phase == PAUSED and self.reason.startswith(COLLECTIVE_ERROR)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class ReformChannel:
    """Both ends of the channel; each side calls only its own half."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def _pause_file(self) -> Path:
        return self.directory / "pause.json"

    def _assignment_file(self, local_rank: int) -> Path:
        return self.directory / f"assign-{local_rank}.json"

    def _state_file(self, local_rank: int) -> Path:
        return self.directory / f"state-{local_rank}.json"

    def _write(self, path: Path, record: dict) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(record).encode(), durable=False)

    # ---- the agent's half -----------------------------------------------------------
    def ask_pause(self, round_number: int, broken: bool = False) -> None:
        """`broken`: a member of the round is gone, so its group cannot finish a
        collective; the workers cut their connections instead of waiting for the
        step boundary (worker/broken_round.py)."""
        self._write(self._pause_file(), {"round": round_number, "broken": broken})

    def assign(self, local_rank: int, assignment: Assignment) -> None:
        self._write(self._assignment_file(local_rank), asdict(assignment))

    def states(self) -> dict[int, WorkerState]:
        """Every worker's last report, by local rank; unreadable reports are skipped."""
        found = {}
        for path in self.directory.glob("state-*.json"):
            record = _read(path)
            try:
                found[int(path.stem.split("-", 1)[1])] = WorkerState(**record)
            except (TypeError, ValueError):
                continue
        return found

    def reset(self) -> None:
        """Forget everything (a restart-path round starts from a clean channel)."""
        for path in self.directory.glob("*.json"):
            path.unlink(missing_ok=True)

    # ---- a worker's half -------------------------------------------------------------
    def pause_asked(self, round_number: int) -> bool:
        return self._pause_request(round_number) is not None

    def broken(self, round_number: int) -> bool:
        request = self._pause_request(round_number)
        return request is not None and request.get("broken") is True

    def _pause_request(self, round_number: int) -> dict | None:
        record = _read(self._pause_file())
        return record if record is not None and record.get("round") == round_number else None

    def assignment(self, local_rank: int) -> Assignment | None:
        record = _read(self._assignment_file(local_rank))
        try:
            return Assignment(**record) if record is not None else None
        except TypeError:
            return None

    def report(self, local_rank: int, state: WorkerState) -> None:
        self._write(self._state_file(local_rank), asdict(state))
