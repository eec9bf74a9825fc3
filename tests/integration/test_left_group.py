"""A rank that leaves a round on a failed collective does not hold its peers.

Destroying a gloo group closes its connections only once nothing else holds the
group (a DDP's reducer, a frame kept alive by a traceback); until then a peer still
in a collective with the rank that left waits out the collective timeout (120 s
here). `leave_process_group(cut=True)`, what a worker does when it leaves a round on
a collective error (worker/elastic.py), shuts the connections down first. The test
allows 60 s in all.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_peer_in_a_collective_with_a_rank_that_left_with_the_cut_fails_at_once(tmp_path):
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.helpers.left_group", str(rank),
                               str(tmp_path / "store"), str(tmp_path / "left"), "cut"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in (0, 1)]
    try:
        assert ranks[1].stdout.readline().strip() == "left"
        output = ranks[0].communicate(timeout=60)[0]
        assert ranks[0].returncode == 0, output
        failed = next(line for line in output.splitlines() if line.startswith("failed"))
        assert "Connection closed" in failed or "Connection reset" in failed, failed
    finally:
        for process in ranks:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)
