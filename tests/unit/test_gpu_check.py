"""scripts/gpu_check.py's decisions, on synthetic worker records: a passing run, and
each way a run can fail one check (and only that one)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gc = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gc  # dataclasses resolve their module by name
_spec.loader.exec_module(gc)

EXPECT = gc.Expectation(world=2, backend="nccl", steps=60, budget_s=240, pause_bound_s=60)
NAMES = ["workers started", "backend", "first collective", "collective failure injected",
         "communicator abort", "re-formed in place", "round increased", "new communicator", "world size",
         "device binding kept", "state sent to ranks behind", "training finished",
         "within time"]


def worker_records(rank: int, world: int = 2, pid: int | None = None) -> list[dict]:
    """What one worker of a passing NCCL run writes."""
    pid = pid or 1000 + rank
    formed = {"kind": "formed", "pid": pid, "rank": rank, "world": world, "local_rank": rank,
              "backend": "nccl", "device": "cuda:0", "cuda_device": 0}
    return [
        {"kind": "start", "pid": pid, "t": 0.0, "local_rank": rank},
        {"kind": "init", "pid": pid, "t": 2.0, "init_s": 2.0, "first_collective_s": 0.8,
         "backend": "nccl", "device": "cuda:0"},
        {**formed, "t": 3.0, "round": 0, "new_group": None, "nccl_uid": 0,
         "collective_s": 0.8},
        {"kind": "failed", "pid": pid, "t": 4.0, "round": 0, "rank": rank, "step": 20,
         "steps": 19, "steps_s": 0.19, "nccl_aborted": 1, "raised": "DistBackendError"},
        {**formed, "t": 5.5, "round": 1, "new_group": True, "nccl_uid": 1,
         "collective_s": 0.4, "checksum": 12.5, "received": 0 if rank == 0 else 4096,
         "sync_source": None if rank == 0 else 0, "sync_s": 0.02},
        {"kind": "steps", "pid": pid, "t": 6.0, "round": 1, "rank": rank, "steps": 41,
         "steps_s": 0.41, "last_step": 60},
        {"kind": "done", "pid": pid, "t": 6.1, "last_step": 60},
    ]


def passing(world: int = 2) -> list[dict]:
    return [r for rank in range(world) for r in worker_records(rank, world)]


def failed_names(records: list[dict], expect=EXPECT, exit_code=0, wall_s=30.0) -> list[str]:
    return [c.name for c in gc.evaluate(records, expect, exit_code, wall_s) if not c.ok]


def edit(records: list[dict], kind: str, round_: int | None = None, **changes) -> list[dict]:
    return [{**r, **changes} if r["kind"] == kind and round_ in (None, r.get("round"))
            else r for r in records]


def test_a_passing_run_passes_every_check_in_order():
    checks = gc.evaluate(passing(), EXPECT, 0, 30.0)
    assert [c.name for c in checks] == NAMES
    assert all(c.ok for c in checks)


def test_one_gpu_gives_a_world_of_one():
    expect = gc.Expectation(1, "nccl", 60, 240, 60)
    assert failed_names(passing(world=1), expect) == []


def test_parse_records_skips_cut_and_foreign_lines():
    lines = [json.dumps(r) for r in passing()] + ['{"kind": "formed", "pid"', "[]", "{}"]
    assert gc.parse_records(lines) == passing()


@pytest.mark.parametrize("records, expect_failed", [
    pytest.param(worker_records(0), ["workers started", "world size", "state sent to ranks behind"],
                 id="a worker missing"),
    pytest.param(edit(passing(), "formed", backend="gloo"), ["backend"], id="gloo not nccl"),
    pytest.param(edit(passing(), "init", first_collective_s=None), ["first collective"],
                 id="no first collective"),
    pytest.param(edit(passing(), "formed", 0, collective_s=None), ["first collective"],
                 id="no collective in the training function"),
    pytest.param([r for r in passing() if not (r["kind"] == "failed" and r["pid"] == 1001)],
                 ["collective failure injected", "communicator abort", "within time"],
                 id="one rank never failed"),
    pytest.param(edit(passing(), "failed", raised="RuntimeError"), ["communicator abort"],
                 id="the all-reduce after the abort raised something else"),
    pytest.param(edit(passing(), "failed", raised=None), ["communicator abort"],
                 id="the all-reduce after the abort succeeded"),
    pytest.param(edit(passing(), "failed", nccl_aborted=0), ["communicator abort"],
                 id="no NCCL group found to abort"),
    pytest.param(edit(passing(), "formed", 1, new_group=False), ["new communicator"],
                 id="old group kept"),
    pytest.param(edit(passing(), "formed", 1, nccl_uid=0), ["new communicator"],
                 id="same nccl communicator"),
    pytest.param(edit(passing(), "formed", 1, cuda_device=1), ["device binding kept"],
                 id="device moved"),
    pytest.param(edit(passing(), "formed", 1, world=1), ["world size"], id="wrong world"),
    pytest.param([{**r, "checksum": 1.0} if r["kind"] == "formed" and r.get("round") == 1
                  and r["rank"] == 1 else r for r in passing()],
                 ["state sent to ranks behind"], id="ranks disagree after the sync"),
    pytest.param(edit(passing(), "formed", 1, received=0), ["state sent to ranks behind"],
                 id="nothing received"),
    pytest.param(edit(passing(), "done", last_step=59), ["training finished"],
                 id="stopped short"),
])
def test_each_failure_fails_its_own_check(records, expect_failed):
    assert failed_names(records) == expect_failed


def test_the_restart_path_is_not_in_place():
    """New processes train the later round: the pids changed, the group was restarted."""
    records = [r for r in passing() if r["kind"] in ("start", "init")
               or r.get("round") == 0 or r["kind"] == "failed"]
    for rank in range(2):
        later = [r for r in worker_records(rank, pid=2000 + rank)
                 if r.get("round") == 1 or r["kind"] in ("steps", "done")]
        records += later
    failed = failed_names(records)
    assert "re-formed in place" in failed and "round increased" in failed
    detail = next(c.detail for c in gc.evaluate(records, EXPECT, 0, 30.0)
                  if c.name == "re-formed in place")
    assert "restart path" in detail and "2000" in detail


def test_no_re_formation_at_all():
    records = [r for r in passing() if r.get("round", 0) == 0 and r["kind"] != "done"]
    assert failed_names(records, exit_code=1) == [
        "re-formed in place", "round increased", "new communicator", "device binding kept",
        "state sent to ranks behind", "training finished", "within time"]


@pytest.mark.parametrize("exit_code, wall_s, expect_failed", [
    (1, 30.0, ["training finished"]),
    (None, 240.5, ["training finished", "within time"]),
])
def test_the_launcher_outcome_counts(exit_code, wall_s, expect_failed):
    assert failed_names(passing(), exit_code=exit_code, wall_s=wall_s) == expect_failed


def test_a_slow_pause_fails_the_time_check():
    records = edit(passing(), "formed", 1, t=70.0)
    assert failed_names(records) == ["within time"]


def test_nothing_written_fails_every_check():
    assert failed_names([], exit_code=1) == NAMES


def test_timings_take_the_slowest_rank():
    records = [{**r, "t": 6.0} if r["kind"] == "formed" and r["round"] == 1
               and r["pid"] == 1001 else r for r in passing()]  # rank 1's pause: 2.0 s
    times = {label: value for label, value, _ in gc.timings(records, 30.0)}
    assert times["re-formation pause (failure -> new group's first collective)"] == 2.0
    assert times["er.init (process group formed)"] == 2.0
    assert times["first collective after er.init (on NCCL: creates the communicator)"] == 0.8
    assert times["step before the failure"] == pytest.approx(10.0)
    assert times["step after re-forming"] == pytest.approx(10.0)
    assert times["elastic-run, start to exit"] == 30.0


def test_timings_of_a_run_that_never_re_formed_are_unknown():
    times = {label: value for label, value, _ in gc.timings([], 12.0)}
    assert times["re-formation pause (failure -> new group's first collective)"] is None


def test_the_report_has_one_line_per_check_and_a_verdict():
    checks = gc.evaluate(edit(passing(), "formed", 1, cuda_device=1), EXPECT, 0, 30.0)
    report = gc.format_report(checks, gc.timings(passing(), 30.0)).splitlines()
    verdicts = [line for line in report if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == len(NAMES)
    assert [line.split()[0] for line in verdicts].count("FAIL") == 1
    assert report[-1] == "gpu_check: 12 of 13 checks passed; failed: device binding kept"
    assert any(line.startswith("time  re-formation pause") and line.endswith("1.500 s")
               for line in report)


def test_cannot_run_without_a_gpu_on_a_cpu_torch():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    with pytest.raises(gc.CannotRun, match="GPU"):
        gc.visible_gpus()


def test_the_communicator_abort_is_only_checked_on_nccl():
    gloo = gc.Expectation(world=2, backend="gloo", steps=60, budget_s=240, pause_bound_s=60)
    records = edit(edit(passing(), "failed", nccl_aborted=None, raised=None), "formed",
                   backend="gloo")
    check = next(c for c in gc.evaluate(records, gloo, 0, 30.0) if c.name == "communicator abort")
    assert check.ok and "not applicable" in check.detail


@pytest.mark.parametrize("answer, ok, says", [
    ({"dynamo": True, "cuda_initialized": False, "holds_gpu": False}, True,
     "nvidia-smi lists no context of it"),
    ({"dynamo": True, "cuda_initialized": False, "holds_gpu": None}, True, "nvidia-smi not found"),
    ({"dynamo": False, "cuda_initialized": False, "holds_gpu": False}, False, "not imported ahead"),
    ({"dynamo": True, "cuda_initialized": True, "holds_gpu": False}, False, "CUDA context"),
    ({"dynamo": True, "cuda_initialized": False, "holds_gpu": True}, False, "CUDA context"),
    ({"error": "exit 1: ModuleNotFoundError: No module named 'torch'"}, False,
     "gave no answer (exit 1: ModuleNotFoundError"),
])
def test_the_waiting_interpreter_must_import_ahead_and_hold_no_gpu(answer, ok, says):
    check = gc.prewarm_check(answer)
    assert (check.name, check.ok) == ("waiting interpreter (--prewarm)", ok)
    assert says in check.detail

