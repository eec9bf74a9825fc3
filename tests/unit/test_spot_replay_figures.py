"""bench/spot_replay.py: the boot figures, on a hand-written step log and schedule."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def replay():
    sys.path.insert(0, str(BENCH))  # spot_replay imports its neighbours by name
    try:
        spec = importlib.util.spec_from_file_location("spot_replay", BENCH / "spot_replay.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def write_log(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def job_with(tmp_path: Path, rows: list[dict], agents: dict[str, int], started: dict[str, float]):
    write_log(tmp_path / "steps.jsonl", rows)
    return SimpleNamespace(steps_file=tmp_path / "steps.jsonl", started_at=started,
                           agents={n: SimpleNamespace(pid=pid) for n, pid in agents.items()})


def test_the_scripts_boot_counts_the_model_and_optimizer_after_import_torch(replay, tmp_path):
    """Two nodes, each alive 20 s of a 40 s replay: import torch 2 s, the model and
    optimizer 1.5 s more. The ceilings are 1 - boot / 20 s; a start row from a
    workload without `model_s` leaves the script's ceiling out, never guesses it."""
    t0 = 1000.0
    rows = [{"kind": "start", "t_proc": t0 + s, "t_torch": t0 + s + 2.0, "model_s": 1.5,
             "t_pg": t0 + s + 2.1, "ppid": pid, "pid": pid + 1}
            for s, pid in ((0.0, 10), (20.0, 20))]
    rows += [{"kind": "step", "t": t0 + 4.0, "ppid": 10, "pid": 11, "rank": 0, "step": 1},
             {"kind": "step", "t": t0 + 25.0, "ppid": 20, "pid": 21, "rank": 0, "step": 2}]
    log = [{"t": 0.0, "event": "add", "node": "a"}, {"t": 20.0, "event": "reclaim", "node": "a"},
           {"t": 20.0, "event": "add", "node": "b"}]
    job = job_with(tmp_path, rows, {"a": 10, "b": 20}, {"a": t0, "b": t0 + 20.0})
    figures = replay.boot_figures(job, log, 40.0, t0, t0 + 40.0)
    assert figures["boot_import_s"] == pytest.approx(2.0)
    assert figures["boot_ceiling"] == pytest.approx(1 - 2.0 / 20)
    assert figures["boot_script_s"] == pytest.approx(3.5)
    assert figures["boot_ceiling_script"] == pytest.approx(1 - 3.5 / 20)
    assert figures["node_first_step_s"] == pytest.approx(4.5)  # 4 s and 5 s

    for row in rows:
        row.pop("model_s", None)
    older = replay.boot_figures(job_with(tmp_path, rows, {"a": 10, "b": 20},
                                         {"a": t0, "b": t0 + 20.0}), log, 40.0, t0, t0 + 40.0)
    assert older["boot_script_s"] is None and older["boot_ceiling_script"] is None
    assert older["boot_ceiling"] == pytest.approx(figures["boot_ceiling"])
