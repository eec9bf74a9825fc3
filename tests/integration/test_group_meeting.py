"""A group made in the training function forms only after its members met in the
round's store, and a round cut meanwhile fails the making at once.

Why a test of its own: gloo waits in the store for every member's address, in C++,
for the group's whole timeout; a member lost just then held the others 12 s in two
chaos soaks while their agents had already cut the round (formation.meet_members).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from elastic_runner.reform import ReformChannel

ROOT = Path(__file__).resolve().parents[2]


def start(tmp_path: Path, mode: str) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-m", "tests.helpers.group_meeting", str(rank),
                              str(tmp_path / "store"), str(tmp_path / f"channel-{rank}"), mode],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank in range(3)]


def stop(ranks: list[subprocess.Popen]) -> None:
    for process in ranks:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)


def test_a_cut_round_fails_a_group_whose_member_is_lost_without_its_timeout(tmp_path):
    """The group's timeout is 120 s; the test allows 60 s in all."""
    ranks = start(tmp_path, "lost")
    try:
        for rank in (0, 1):
            assert ranks[rank].stdout.readline().strip() == "making"
            meeting = ranks[rank].stdout.readline().split()
            assert meeting[0] == "meeting" and meeting[2:] == ["3", "120"], meeting
        for rank in (0, 1):
            ReformChannel(tmp_path / f"channel-{rank}").ask_pause(0, broken=True)
        outputs = [ranks[rank].communicate(timeout=60)[0] for rank in (0, 1)]
        assert [ranks[rank].returncode for rank in (0, 1)] == [0, 0], outputs
        for output in outputs:
            failed = next(line for line in output.splitlines() if line.startswith("failed"))
            assert "the round was cut while group" in failed, output
    finally:
        stop(ranks)


def test_members_meet_and_get_their_group_and_a_non_member_meets_nobody(tmp_path):
    ranks = start(tmp_path, "pair")
    try:
        outputs = [process.communicate(timeout=60)[0] for process in ranks]
        assert [process.returncode for process in ranks] == [0, 0, 0], outputs
        for rank in (0, 1):
            assert "sum 2" in outputs[rank].splitlines(), outputs[rank]
            assert any(line.startswith("meeting ") and line.split()[2] == "2"
                       for line in outputs[rank].splitlines()), outputs[rank]
        assert not any(line.startswith(("meeting", "sum")) for line in outputs[2].splitlines())
    finally:
        stop(ranks)
