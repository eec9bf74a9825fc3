"""Metrics and the timeline report on a real run: two agents, gloo workers, one killed."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from elastic_runner.events import read_events
from elastic_runner.cli.report import timeline_data
from tests.e2e.harness import Job

# A tiny trainer: reports progress every step and checkpoints every 20 steps.
WORKER = textwrap.dedent('''
    import sys, time
    import torch
    import torch.distributed as dist
    import elastic_runner as er

    with er.init() as ctx:
        ckpt = er.Checkpointer(sys.argv[1], keep=2, every=20)
        state = ckpt.load_latest()
        model = torch.nn.Linear(4, 1)
        if state:
            model.load_state_dict(state["model"])
        step = state["step"] if state else 0
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        samples = 0
        while True:
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            step, samples = step + 1, samples + 8
            er.report(step, samples)
            if ckpt.due(step):
                ckpt.save(step, {"model": model.state_dict(), "step": step})
            time.sleep(0.05)
''')


def write_worker(directory: Path) -> Path:
    script = directory / "tiny_worker.py"
    script.write_text(WORKER)
    return script


def metrics_url(job: Job, node: str) -> str:
    def found():
        match = re.search(r"metrics at http://[^:]+:(\d+)/metrics", job.agent_log(node))
        return match and f"http://127.0.0.1:{match.group(1)}/metrics"
    return job.wait_for(found, 60, f"the metrics line of agent {node}")


def scrape(url: str) -> dict[str, float]:
    """Sample name (with labels) -> value, from the Prometheus text format."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def wait_metric(job: Job, url: str, predicate, what: str) -> dict[str, float]:
    return job.wait_for(lambda: (lambda s: s if predicate(s) else None)(scrape(url)), 90, what)


@pytest.mark.e2e
def test_metrics_follow_a_kill_and_report_plots_it(etcd, tmp_path):
    log_dir = tmp_path / "logs"
    events = log_dir / "events.jsonl"
    job = Job(etcd.endpoint, tmp_path, run_id="metrics", min_nodes=1, max_nodes=2, nproc=1,
              script=write_worker(tmp_path), script_args=(str(tmp_path / "ckpt"),))
    try:
        job.start("a", "b", metrics_port=0, log_dir=log_dir)
        url_a = metrics_url(job, "a")
        wait_metric(job, url_a, lambda s: s.get("elastic_run_world_size") == 2
                    and s.get("elastic_run_steps_per_second", 0) > 0,
                    "world size 2 and steps/s > 0 on a")
        job.wait_for(lambda: any(e["kind"] == "checkpoint_saved" for e in read_events(events)),
                     60, "a first checkpoint")
        job.kill("b")
        # The resize's pause is in the wait too: a scrape between the round's close and
        # the new workers' start still saw the old round's rank files (steps/s > 0) and
        # world size 1, before the agent had recorded the pause (seen once).
        after = wait_metric(job, url_a, lambda s: s.get("elastic_run_world_size") == 1
                            and s.get("elastic_run_steps_per_second", 0) > 0
                            and s.get("elastic_run_rescale_pause_seconds_count", 0) >= 1,
                            "world size 1, a rescale pause and training again on a")
        assert after["elastic_run_rescale_pause_seconds_count"] >= 1
        assert after["elastic_run_rounds_total"] >= 2
        # The survivor's gloo worker may fail before b's lease expires: either cause counts.
        assert sum(v for k, v in after.items() if k.startswith("elastic_run_restarts_total{")) >= 1
        assert after["elastic_run_samples_per_second"] > 0
        # a now hosts rank 0: its checkpoints show up as age, step and save time.
        saved = wait_metric(job, url_a, lambda s: s.get("elastic_run_checkpoint_step", 0) > 0
                            and s.get("elastic_run_checkpoint_save_seconds_count", 0) >= 1,
                            "checkpoint metrics on a")
        assert 0 <= saved["elastic_run_checkpoint_age_seconds"] < 60
    finally:
        job.stop_all()

    png, page = tmp_path / "out.png", tmp_path / "out.html"
    done = subprocess.run([sys.executable, "-m", "elastic_runner", "report", str(log_dir),
                           "-o", str(png), "--html", str(page)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert png.stat().st_size > 10_000
    assert "data:image/png;base64," in page.read_text()
    records = read_events(events)
    data = timeline_data(records)
    resized_rounds = {e["round"] for e in records if e["kind"] == "resize"}
    assert len(data.resize_times) == len(resized_rounds) >= 1
    assert data.world_sizes[-1] == 1 and 2 in data.world_sizes
    assert data.checkpoint_steps and data.down_intervals
