"""A gloo collective blocked on a frozen member fails at once when the round is marked broken.

Three real processes form a gloo group with a 120 s collective timeout; member 2
stops itself (SIGSTOP: its sockets stay open, nothing answers). Without the cut the
other two would wait the whole 120 s; the test allows 60 s in all.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_runner.reform import ReformChannel

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("group", ["default", "subgroup"])
def test_marking_the_round_broken_fails_the_blocked_collective_of_each_rank(tmp_path, group):
    """`subgroup`: on a group the training function made itself, whose own timeout
    (torch's default for gloo) is 30 minutes."""
    store = tmp_path / "store"
    extra = ["subgroup"] if group == "subgroup" else []
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.helpers.cut_group", str(rank),
                               str(store), str(tmp_path / f"channel-{rank}"), *extra], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(3)]
    try:
        for rank in (0, 1):
            assert ranks[rank].stdout.readline().strip() == "blocked"
        time.sleep(0.5)  # well inside the all-reduce that waits for member 2
        for rank in (0, 1):
            ReformChannel(tmp_path / f"channel-{rank}").ask_pause(0, broken=True)
        outputs = [ranks[rank].communicate(timeout=60)[0] for rank in (0, 1)]
        assert [ranks[rank].returncode for rank in (0, 1)] == [0, 0], outputs
        for output in outputs:
            failed = next(line for line in output.splitlines() if line.startswith("failed"))
            assert "Connection closed" in failed or "Connection reset" in failed, output
    finally:
        for process in ranks:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)
