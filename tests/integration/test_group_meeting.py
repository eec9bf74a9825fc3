"""A group made in the training function forms only after its members met in the
round's store, and a round cut meanwhile fails the making at once.

Why a test of its own: gloo waits in the store for every member's address, in C++,
for the group's whole timeout; a member lost just then held the others 12 s in two
chaos soaks while their agents had already cut the round (formation.meet_members).
"""

from __future__ import annotations

from tests.helpers.three_ranks import break_round_and_read_failures, three_ranks


def test_a_cut_round_fails_a_group_whose_member_is_lost_without_its_timeout(tmp_path):
    """The group's timeout is 120 s; the test allows 60 s in all."""
    with three_ranks("tests.helpers.group_meeting", tmp_path, "lost") as ranks:
        for rank in (0, 1):
            assert ranks[rank].stdout.readline().strip() == "making"
            meeting = ranks[rank].stdout.readline().split()
            assert meeting[0] == "meeting" and meeting[2:] == ["3", "120"], meeting
        for failed in break_round_and_read_failures(tmp_path, ranks):
            assert "the round was cut while group" in failed, failed


def test_members_meet_and_get_their_group_and_a_non_member_meets_nobody(tmp_path):
    with three_ranks("tests.helpers.group_meeting", tmp_path, "pair") as ranks:
        outputs = [process.communicate(timeout=60)[0] for process in ranks]
        assert [process.returncode for process in ranks] == [0, 0, 0], outputs
        for rank in (0, 1):
            assert "sum 2" in outputs[rank].splitlines(), outputs[rank]
            assert any(line.startswith("meeting ") and line.split()[2] == "2"
                       for line in outputs[rank].splitlines()), outputs[rank]
        assert not any(line.startswith(("meeting", "sum")) for line in outputs[2].splitlines())
