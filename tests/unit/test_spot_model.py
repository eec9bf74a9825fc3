"""bench/spot_model.py: the discrete-event model's rules, on hand-made traces and parameters."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "spot_model.py"
_spec = importlib.util.spec_from_file_location("spot_model", SCRIPT)
sm = importlib.util.module_from_spec(_spec)
sys.modules["spot_model"] = sm          # dataclasses resolve their module by name
_spec.loader.exec_module(sm)

JOB = sm.Job(restart_floor_s=10.0, checkpoint_load_s=4.0, checkpoint_interval_s=100.0,
             checkpoint_save_s=2.0, step_s=1.0, state_bytes=1e9, bandwidth_Bps=1e9,
             samples_per_node_s=2.0, price_per_node_hour=3.6, unnoticed_fraction=0.0)
TR = sm.Torchrun("tr", "torchrun", keepalive_timeout_s=15.0, last_call_s=30.0, join_detect_s=2.0,
                 start_rendezvous_s=3.0, host_death_s=1.0, dies_on_join=False, join_death_s=0.0)
ER = sm.RestartElastic("er", "elastic-run", kill_detect_s=5.0, rendezvous_s=1.0,
                       join_rendezvous_s=1.5, start_rendezvous_s=0.5, saves_on_notice=False)
INPROC = sm.InProcessElastic("er-inproc", "in-process", detection_s=1.0, reform_s=0.5,
                             join_reform_s=1.0, start_rendezvous_s=0.5, survivors_hold_state=True)
LAUNCHERS = (TR, replace(TR, key="tr-dies", dies_on_join=True, join_death_s=60.0), ER,
             replace(ER, key="er+ckpt", saves_on_notice=True), INPROC)
SHIPPED = [sm.load_trace(p) for p in sm.TRACES]


def trace(*points, end):
    return sm.Trace("test", tuple(points), float(end))


def test_a_trace_without_events_gives_goodput_one_for_every_launcher():
    flat = trace((0.0, 4), end=36000)
    gpu = sm.gpu_profile(sm.measured_profile({}, {}))
    for launcher in LAUNCHERS + gpu.launchers:
        tl = sm.simulate(flat, launcher, JOB)
        assert tl.goodput == 1.0 and tl.paused_s == 0 and tl.events == ()


def test_one_sigkill_costs_exactly_the_pause_and_the_work_since_the_checkpoint():
    kill = replace(JOB, unnoticed_fraction=1.0)
    t_kill, end = 250.0, 1000.0                 # 50 s after the checkpoint at 200 s
    tl = sm.simulate(trace((0.0, 2), (t_kill, 1), end=end), ER, kill)
    pause = ER.kill_detect_s + ER.rendezvous_s + JOB.restart_floor_s + JOB.checkpoint_load_s
    (row,) = tl.events
    assert (row.kind, row.pause_s, row.lost_node_s) == ("kill", pause, 2 * 50.0)
    paid = 2 * t_kill + 1 * (end - t_kill)
    assert tl.paid_node_s == paid
    assert tl.goodput == pytest.approx((paid - 1 * pause - 2 * 50.0) / paid)


def test_torchrun_pays_the_expected_store_host_loss_and_its_last_call():
    tl = sm.simulate(trace((0.0, 2), (250.0, 1), end=1000), TR, JOB)
    restart = JOB.restart_floor_s + JOB.checkpoint_load_s
    survivors = TR.keepalive_timeout_s + TR.last_call_s + restart
    host = TR.host_death_s + TR.start_rendezvous_s + TR.last_call_s + restart
    assert tl.events[0].pause_s == pytest.approx(0.5 * survivors + 0.5 * host)   # 1 of 2 nodes


def test_in_process_loses_one_step_on_a_sigkill_and_nothing_on_a_notice():
    for fraction, lost, pause in ((1.0, JOB.step_s, 1.5), (0.0, 0.0, 0.5)):
        tl = sm.simulate(trace((0.0, 3), (250.0, 2), end=1000), INPROC,
                         replace(JOB, unnoticed_fraction=fraction))
        assert (tl.events[0].pause_s, tl.events[0].lost_node_s) == (pause, 3 * lost)


def test_work_lost_per_event_never_exceeds_the_checkpoint_interval():
    for interval in (7.0, 100.0, 1800.0):
        job = replace(JOB, checkpoint_interval_s=interval, unnoticed_fraction=0.5)
        for tr in SHIPPED:
            for launcher in LAUNCHERS:
                tl = sm.simulate(tr, launcher, job)
                assert all(e.lost_node_s <= interval * e.before + 1e-9 for e in tl.events)


def test_node_seconds_paid_are_useful_lost_idle_or_unused():
    for tr in SHIPPED:
        for launcher in LAUNCHERS:
            tl = sm.simulate(tr, launcher, replace(JOB, unnoticed_fraction=0.3))
            parts = tl.useful_node_s + tl.lost_node_s + tl.idle_node_s + tl.under_node_s
            assert parts == pytest.approx(tl.paid_node_s, rel=1e-9)
            assert len(tl.events) == len(sm.events_of(tr, 0.3))


def _costs(obj):
    return [f.name for f in fields(obj) if isinstance(getattr(obj, f.name), float)
            and f.name not in ("checkpoint_interval_s", "samples_per_node_s", "price_per_node_hour",
                               "unnoticed_fraction", "bandwidth_Bps")]


def _never_better(tr, launcher, job, skip=()):
    base = sm.simulate(tr, launcher, job).goodput
    for name in _costs(launcher):
        if name not in skip:
            for more in (0.5, 10.0, 100.0):
                worse = replace(launcher, **{name: getattr(launcher, name) + more})
                assert sm.simulate(tr, worse, job).goodput <= base + 1e-12, (launcher.key, name, more)
    for name in _costs(job) + ["bandwidth_Bps"]:
        value = getattr(job, name)
        worse = replace(job, **{name: value / 2 if name == "bandwidth_Bps" else value * 3 + 1})
        assert sm.simulate(tr, launcher, worse).goodput <= base + 1e-12, (launcher.key, name)


def test_goodput_is_monotone_in_each_cost_when_events_do_not_overlap():
    spaced = trace((0.0, 4), (5000.0, 2), (10000.0, 5), (15000.0, 1), (20000.0, 3), end=25000)
    for fraction in (0.0, 1.0):
        for launcher in LAUNCHERS:
            _never_better(spaced, launcher, replace(JOB, unnoticed_fraction=fraction))


def test_on_the_shipped_traces_only_a_longer_last_call_can_help():
    """A round held open longer takes in a newcomer that would otherwise cost a second
    restart (that is what torchrun's last call is for); every other cost only hurts."""
    gpu = sm.gpu_profile(sm.measured_profile({}, {}))
    for tr in SHIPPED:
        for launcher in gpu.launchers:
            _never_better(tr, launcher, gpu.job, skip=("last_call_s",))


def test_in_process_with_free_reformation_beats_restart_based_elastic_run():
    free = replace(INPROC, detection_s=0.0, reform_s=0.0, join_reform_s=0.0)
    for fraction in (0.0, 1.0):
        job = replace(JOB, unnoticed_fraction=fraction)
        for tr in SHIPPED:
            restart = max(sm.simulate(tr, x, job).goodput for x in LAUNCHERS[2:4])
            assert sm.simulate(tr, free, job).goodput > restart


def test_every_kth_reclaim_is_a_sigkill_without_randomness():
    saw = trace(*[(float(i), 4 - i % 2) for i in range(9)], end=10)
    kinds = [e.kind for e in sm.events_of(saw, 0.5) if e.kind != "join"]
    assert kinds == ["notice", "kill", "notice", "kill"]
    assert {e.kind for e in sm.events_of(saw, 0.0)} == {"notice", "join"}


@pytest.mark.parametrize("floor_parts", [
    (("import_torch", 0.5), ("process_group", 0.25), ("ckpt_and_first_step", 0.5)),
    # rescale.json since the model and optimizer build is timed apart from the load
    (("import_torch", 0.5), ("process_group", 0.25), ("model_and_optimizer", 0.3),
     ("ckpt_and_first_step", 0.2))])
def test_the_measured_profile_adds_up_to_the_measured_totals(floor_parts):
    totals = {"start": 3.0, "sigkill": 40.0, "join": 2.5, "sigterm": 39.0}
    rescale = {"restart_floor": {k: {"median": v} for k, v in floor_parts},
               "args": {"every": 20},
               "summary": {v: {ev: {"s": {"median": s}, "failures": []} for ev, s in totals.items()}
                           for v in ("tr", "tr-noshare", "er", "er+ckpt")}}
    p = sm.measured_profile(rescale, {})
    events = {"start": sm.Event(0, "join", 0, 2), "sigkill": sm.Event(0, "kill", 2, 1),
              "join": sm.Event(0, "join", 1, 2), "sigterm": sm.Event(0, "notice", 2, 1)}
    for launcher in p.launchers[:4]:
        for name, ev in events.items():
            if launcher.key.startswith("tr") and name == "sigterm":
                continue                       # torchrun: the same path as a SIGKILL
            assert launcher.respond(ev, p.job, 2, 0.0).pause_s == pytest.approx(totals[name])
    assert p.job.restart_floor_s + p.job.checkpoint_load_s == pytest.approx(1.25)
    sources = dict(p.sources)
    assert sources["er.rendezvous_s"].startswith("measured")
    assert sources["job.step_s"].startswith("assumed")       # no spot_replay.json given
    assert sources["er-inproc.reform_s"].startswith("assumed (issue 15 goal")


def test_an_in_process_row_in_rescale_json_replaces_the_goals():
    totals = {"start": 2.0, "sigkill": 1.25, "join": 2.5, "sigterm": 0.25}
    rescale = {"restart_floor": {k: {"median": 0.5} for k in ("import_torch", "process_group", "ckpt_and_first_step")},
               "summary": {"er-inproc": {ev: {"s": {"median": s}} for ev, s in totals.items()}}}
    p = sm.measured_profile(rescale, {})
    inproc = p.launchers[-1]
    assert inproc.respond(sm.Event(0, "kill", 2, 1), p.job, 2, 0.0).pause_s == pytest.approx(1.25)
    assert inproc.respond(sm.Event(0, "notice", 2, 1), p.job, 2, 0.0).pause_s == pytest.approx(0.25)
    join = inproc.respond(sm.Event(0, "join", 1, 2), p.job, 2, 0.0)
    assert join.lag_s + join.pause_s == pytest.approx(2.5)
    assert all(s.startswith("measured") for k, s in p.sources if k.startswith("er-inproc.") and k.endswith("_s"))


def test_a_measured_join_pause_is_the_others_pause_and_the_newcomer_boots_meanwhile():
    """rescale.py now times the others' pause on a join directly (standby newcomers):
    the model's join pause is that, the transfer measured apart; the boot is lag."""
    totals = {"start": 2.0, "sigkill": 1.25, "join": 6.0, "sigterm": 0.25}
    summary = {ev: {"s": {"median": s}} for ev, s in totals.items()}
    summary["join"].update(pause_s={"median": 0.66}, sync_s={"median": 0.04})
    rescale = {"restart_floor": {k: {"median": 0.5} for k in ("import_torch", "process_group", "ckpt_and_first_step")},
               "summary": {"er-inproc": summary}}
    p = sm.measured_profile(rescale, {})
    join = p.launchers[-1].respond(sm.Event(0, "join", 1, 2), p.job, 2, 0.0)
    transfer = p.job.state_bytes / p.job.bandwidth_Bps
    assert join.pause_s == pytest.approx(0.62 + transfer)
    assert join.lag_s == pytest.approx(p.job.restart_floor_s)  # the others train meanwhile
    assert dict(p.sources)["er-inproc.join_reform_s"] == \
        "measured (rescale.json:er-inproc.join.pause_s - sync_s)"


def test_without_measurement_files_no_parameter_claims_to_be_measured():
    p = sm.measured_profile({}, {})
    sources = dict(p.sources)
    assert not [k for k, s in sources.items() if "measured (" in s], sources
    assert sources["er.rendezvous_s"].startswith("assumed (bench/README.md")


@pytest.mark.parametrize("name, text", [("missing.csv", None), ("bad.csv", "0,1\nfoo\n"),
                                        ("bad.json", '{"metadata": {}}'), ("neg.csv", "0,-1\n")])
def test_a_missing_or_malformed_trace_is_one_line_and_exit_code_2(tmp_path, name, text):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    done = subprocess.run([sys.executable, str(SCRIPT), "--trace", str(path), "--no-save"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1
    assert str(path) in done.stderr
