"""State.sync between real gloo ranks: the bytes of the state in buckets, loaded only
once all of them arrived (worker/state_transfer.py; the ranks: tests/helpers/transfer_group.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from elastic_runner.etcd.server import free_port

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "transfer_group.py"


def run(scenario: str, out: Path) -> list[dict]:
    done = subprocess.run([sys.executable, str(HELPER), scenario, str(out), str(free_port())],
                          capture_output=True, text=True, timeout=180)
    found = sorted(out.glob("rank*.json"))
    assert found, f"no rank wrote a result (rc {done.returncode}):\n{done.stderr[-3000:]}"
    return [json.loads(path.read_text()) for path in found]


def test_ranks_behind_receive_the_whole_state_across_many_buckets(tmp_path):
    ranks = run("three", tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    source = ranks[0]
    assert source["received"] == 0 and source["after"] == source["before"]
    for rank in ranks[1:]:
        assert rank["before"] != source["before"]  # a fresh model, no Adam state
        assert rank["after"] == source["after"] and rank["step"] == 3
        assert rank["seen"] == ranks[0]["seen"] == 24
        assert rank["adam_states"] == ranks[0]["adam_states"] == 3  # embed (tied), hidden w, b
        assert rank["tied"]  # the tied weight is still one tensor
        # Every tensor's bytes (the tied weight twice: it has two names) and the
        # skeleton, through buckets of 1,000 bytes.
        assert rank["received"] > source["tensor_bytes"] > 14_000


def test_a_rank_already_at_the_newest_step_moves_no_bytes(tmp_path):
    ranks = run("equal", tmp_path)
    assert [r["received"] for r in ranks[:2]] == [0, 0]
    assert ranks[2]["received"] > 0
    assert {r["after"] for r in ranks} == {ranks[0]["before"]}
    assert [r["step"] for r in ranks] == [3, 3, 3]


def test_a_source_lost_mid_transfer_leaves_the_receivers_objects_untouched(tmp_path):
    ranks = run("source-dies", tmp_path)
    assert [r["rank"] for r in ranks] == [1, 2]  # rank 0 died mid-way
    for rank in ranks:
        assert rank["collective_failure"], rank["error"]
        assert rank["after"] == rank["before"] and rank["step"] == -1
        assert rank["adam_states"] == 0 and rank["seen"] == 0


def test_a_transfer_held_by_a_frozen_source_fails_once_the_round_is_cut(tmp_path):
    """Seen in a chaos soak: a rank sat in the transfer's send for the whole 12 s
    collective timeout after its agent had cut the round, because the transfer's own
    group was not among the connections the cut reaches. Here the receivers cut 1 s
    after the source stopped sending (30 s collective timeout)."""
    ranks = run("source-holds", tmp_path)
    assert [r["rank"] for r in ranks] == [1, 2]
    for rank in ranks:
        assert rank["collective_failure"], rank.get("error")
        assert rank["sync_s"] < 10.0
        assert rank["after"] == rank["before"] and rank["step"] == -1


def test_the_transfer_group_gives_up_with_the_rounds_timeout(tmp_path):
    """Without a cut, the transfer's own group times out as the round's group does
    (4 s here), not after torch's default for a new gloo group, 30 minutes."""
    ranks = run("source-holds-uncut", tmp_path)
    assert [r["rank"] for r in ranks] == [1, 2]
    for rank in ranks:
        assert rank["collective_failure"], rank.get("error")
        assert 3.0 < rank["sync_s"] < 30.0
