"""Three rank processes of a helper module (`python -m tests.helpers.X RANK STORE
CHANNEL ...`), each with its own reform channel, as the cut tests drive them."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from elastic_runner.reform import ReformChannel

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def three_ranks(module: str, folder: Path, *extra: str) -> Iterator[list[subprocess.Popen]]:
    """The ranks, SIGKILLed on the way out if still running."""
    ranks = [subprocess.Popen([sys.executable, "-m", module, str(rank), str(folder / "store"),
                               str(folder / f"channel-{rank}"), *extra], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(3)]
    try:
        yield ranks
    finally:
        for process in ranks:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)


def break_round_and_read_failures(folder: Path, ranks: list[subprocess.Popen]) -> list[str]:
    """Mark round 0 broken in ranks 0 and 1's channels; each one's "failed ..." line,
    once both exited 0 (60 s in all: well under the helpers' 120 s timeouts)."""
    for rank in (0, 1):
        ReformChannel(folder / f"channel-{rank}").ask_pause(0, broken=True)
    outputs = [ranks[rank].communicate(timeout=60)[0] for rank in (0, 1)]
    assert [ranks[rank].returncode for rank in (0, 1)] == [0, 0], outputs
    return [next(line for line in output.splitlines() if line.startswith("failed"))
            for output in outputs]
