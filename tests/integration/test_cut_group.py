"""A gloo collective blocked on a frozen member fails at once when the round is marked broken.

Three real processes form a gloo group with a 120 s collective timeout; member 2
stops itself (SIGSTOP: its sockets stay open, nothing answers). Without the cut the
other two would wait the whole 120 s; the test allows 60 s in all.
"""

from __future__ import annotations

import time

import pytest

from tests.helpers.three_ranks import break_round_and_read_failures, three_ranks


@pytest.mark.parametrize("group", ["default", "subgroup"])
def test_marking_the_round_broken_fails_the_blocked_collective_of_each_rank(tmp_path, group):
    """`subgroup`: on a group the training function made itself, whose own timeout
    (torch's default for gloo) is 30 minutes."""
    extra = ["subgroup"] if group == "subgroup" else []
    with three_ranks("tests.helpers.cut_group", tmp_path, *extra) as ranks:
        for rank in (0, 1):
            assert ranks[rank].stdout.readline().strip() == "blocked"
        time.sleep(0.5)  # well inside the all-reduce that waits for member 2
        for failed in break_round_and_read_failures(tmp_path, ranks):
            assert "Connection closed" in failed or "Connection reset" in failed, failed
