"""bench/chaos_soak.py's verdict on hand-made traces: what counts as lost, doubled and
re-done. The soak's exit code and its published "0 lost, 0 doubled" rest on these
rules, so each is checked both ways: the case it must accept and the one it must flag."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "chaos_soak.py"
_spec = importlib.util.spec_from_file_location("chaos_soak", SCRIPT)
soak = importlib.util.module_from_spec(_spec)
sys.modules["chaos_soak"] = soak
_spec.loader.exec_module(soak)

PER_RANK = soak.BATCH // 2
STEPS_PER_EPOCH = soak.SAMPLES // soak.BATCH


def step_lines(step: int, round_: int, ranks=(0, 1), finished=(0, 1), t0: float = 0.0,
               checksums=None) -> list[dict]:
    """One step of two ranks: each logs what it began; those in `finished` log the step."""
    epoch, within = divmod(step, STEPS_PER_EPOCH)
    lines = []
    for rank in ranks:
        first = within * soak.BATCH + rank * PER_RANK
        indices = list(range(first, first + PER_RANK))
        common = {"rank": rank, "round": round_, "pid": 100 + rank, "epoch": epoch,
                  "indices": indices}
        lines.append({"began": step, **common})
        if rank in finished:
            checksum = (checksums or {}).get(rank, float(step))
            lines.append({"step": step, **common, "world": len(ranks),
                          "checksum": checksum, "t": t0 + 0.1 * step})
    return lines


def run(steps: range, round_: int = 0) -> list[dict]:
    return [line for step in steps for line in step_lines(step, round_)]


def verdict(trace: list[dict]) -> dict:
    return soak.analyse(trace, [], [], duration=10.0)


# One whole epoch and the start of the next (cut by the end of the soak).
WHOLE = range(STEPS_PER_EPOCH + 3)


def test_an_undisturbed_run_loses_and_doubles_nothing():
    result = verdict(run(WHOLE))
    assert result["completed_epochs"] == 1
    assert result["samples_lost"] == 0 and result["samples_duplicated"] == 0
    assert result["samples_redone"] == 0 and result["steps_ranks_disagreed"] == 0
    assert result["useful_samples"] == len(WHOLE) * soak.BATCH


def test_a_step_no_rank_logged_is_lost():
    trace = [line for line in run(WHOLE) if line.get("step", line.get("began")) != 5]
    assert verdict(trace)["samples_lost"] == soak.BATCH


def test_a_step_one_rank_completed_before_its_peer_died_counts_whole():
    """Rank 1 died after the last all-reduce reached rank 0: it began the step but never
    logged it, and rank 0 applied the whole gradient. Counted by what was begun, the
    step is whole; counted by the step lines alone it would look half lost (the soak's
    false "21 samples lost")."""
    trace = run(range(10)) + step_lines(10, 0, finished=(0,)) + run(range(11, len(WHOLE)), 1)
    assert verdict(trace)["samples_lost"] == 0
    without_began = [line for line in trace if "began" not in line]
    assert verdict(without_began)["samples_lost"] == PER_RANK


def test_a_step_re_done_in_a_later_round_counts_once_and_as_re_done():
    trace = run(range(20)) + run(range(15, len(WHOLE)), round_=1)  # back to a checkpoint
    result = verdict(trace)
    assert result["samples_duplicated"] == 0 and result["samples_lost"] == 0
    assert result["samples_redone"] == 5 * soak.BATCH


def test_the_same_samples_in_two_steps_are_doubled():
    trace = run(WHOLE)
    for line in trace:
        if line.get("step", line.get("began")) == 7:
            line["indices"] = list(range(PER_RANK * line["rank"], PER_RANK * (line["rank"] + 1)))
    result = verdict(trace)
    assert result["samples_duplicated"] == soak.BATCH and result["samples_lost"] == soak.BATCH


def test_ranks_that_disagree_on_the_parameters_are_counted_per_step():
    trace = run(range(3)) + step_lines(3, 0, checksums={0: 1.0, 1: 2.0}) + run(range(4, 8))
    assert verdict(trace)["steps_ranks_disagreed"] == 1


def test_stalls_are_the_gaps_without_a_finished_step():
    trace = run(range(5)) + step_lines(5, 1, t0=3.0)  # step 4 at 0.4 s, step 5 at 3.5 s
    result = soak.stalls([line for line in trace if "began" not in line])
    assert result == {"stalls_over_0.5s": 1, "time_in_stalls_s": 3.1, "longest_stall_s": 3.1}


def test_drains_count_only_workers_that_stopped_at_a_boundary():
    events = [{"kind": "drain", "ended": "progress", "waited_s": 0.9},
              {"kind": "drain", "ended": "progress", "waited_s": 3.2},
              {"kind": "drain", "ended": "progress", "waited_s": 0.8},
              {"kind": "drain", "ended": "no-boundary", "waited_s": 0.0},  # stopped at once
              {"kind": "drain", "ended": "deadline", "waited_s": 25.0},  # never got there
              {"kind": "resize", "round": 3}]
    assert soak.drains(events) == {"drains_at_a_boundary": 3, "drain_median_s": 0.9,
                                   "drain_longest_s": 3.2}
    assert soak.drains([]) == {}
