"""The agent's metrics and the report, without agents: progress files, rates, cause
labels, the report's timeline (moved from the e2e file: nothing here starts a process)."""

from __future__ import annotations

import pytest

from elastic_runner.agent.metrics import progress_rates, restart_cause
from elastic_runner.cli.report import main as report_main
from elastic_runner.cli.report import timeline_data
from elastic_runner.contract import ProgressWriter, read_progress
from elastic_runner.worker import runtime


def test_report_writes_rate_limited_progress_files(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_RUN_PROGRESS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(runtime, "_progress", [])
    runtime.report(1, 8)
    runtime.report(2, 16)  # within 0.5 s of the first: not written
    [record] = read_progress(tmp_path)
    assert (record["step"], record["samples"]) == (1, 8)
    assert (tmp_path / "rank3.json").exists()


def test_report_is_a_no_op_outside_elastic_run(tmp_path, monkeypatch):
    monkeypatch.delenv("ELASTIC_RUN_PROGRESS_DIR", raising=False)
    monkeypatch.setattr(runtime, "_progress", [])
    runtime.report(1, 8)
    assert runtime._progress[0][1] is None


def test_rates_come_from_the_last_two_reports(tmp_path):
    writer = ProgressWriter(tmp_path / "rank0.json", min_interval_s=0)
    writer.write(10, 80, now=100.0)
    writer.write(30, 240, now=102.0)
    rates = progress_rates(read_progress(tmp_path), now=102.5)
    assert (rates.steps_per_s, rates.samples_per_s) == (10.0, 80.0)
    assert progress_rates(read_progress(tmp_path), now=200.0).steps_per_s == 0.0  # stale
    assert progress_rates([], now=0.0) is None


def test_restart_causes_are_a_small_label_set():
    assert restart_cause("member-lost: b") == "member-lost"
    assert restart_cause("worker-failure: rank 0 on a") == "worker-failure"
    assert restart_cause("newcomer") == "newcomer"
    assert restart_cause("workers checkpointed and stopped for a spot notice") == "notice"


def _event(t, kind, node="a", **fields):
    return {"time": t, "run_id": "r", "node": node, "kind": kind, **fields}


def test_timeline_data_deduplicates_agents_copies():
    events = [
        _event(0, "round_closed", round=0, world_size=4), _event(0, "round_closed", "b", round=0,
                                                                 world_size=4),
        _event(5, "checkpoint_saved", "rank0", step=50, round=0),
        _event(10, "checkpoint_saved", "rank0", step=100, round=0),
        _event(12, "member_lost", round=0, reason="member-lost: c"),
        _event(12.5, "member_lost", "b", round=0, reason="member-lost: c"),
        _event(14, "round_closed", round=1, world_size=2),
        _event(14.1, "round_closed", "b", round=1, world_size=2),
        _event(14.2, "resize", round=1, old_world_size=4, new_world_size=2, pause_s=2.0),
        _event(14.3, "resize", "b", round=1, old_world_size=4, new_world_size=2, pause_s=2.1),
    ]
    data = timeline_data(events)
    assert data.world_sizes == [4, 2] and data.world_times == [0, 14]
    assert data.resize_pauses == [2.0] and data.checkpoint_steps == [50, 100]
    assert data.down_intervals == [(12, 14)] and data.lost_work_intervals == [(10, 12)]
    assert data.steps_per_s == [10.0]


def test_report_without_an_events_file_is_a_clear_error(tmp_path):
    from elastic_runner.errors import ConfigError

    with pytest.raises(ConfigError, match="no events file"):
        report_main([str(tmp_path), "-o", str(tmp_path / "x.png")], {})
