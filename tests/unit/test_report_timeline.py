"""The report's timeline for in-process re-formations: down while paused, no lost work."""

from __future__ import annotations

from elastic_runner.cli.report import timeline_data


def event(t: float, kind: str, node: str = "a", **fields) -> dict:
    return {"time": t, "kind": kind, "node": node, "run": "r", **fields}


def test_an_in_process_loss_is_down_time_but_loses_no_checkpointed_work():
    events = [
        event(0, "round_closed", round=0, world_size=3),
        event(5, "checkpoint_saved", "rank0", step=50, round=0),
        event(9, "reform_started", round=0, reason="member-suspected: a local rank 0"),
        event(9.2, "reform_started", "b", round=0, reason="member-suspected: b"),
        event(10, "round_closed", round=1, world_size=2, inprocess=True),
        event(20, "reform_started", round=1, reason="newcomer"),
        event(21, "round_closed", round=2, world_size=3, inprocess=True),
    ]
    data = timeline_data(events)
    assert data.world_sizes == [3, 2, 3]
    assert data.down_intervals == [(9, 10)]  # the join paused training but crashed nothing
    assert data.lost_work_intervals == []
