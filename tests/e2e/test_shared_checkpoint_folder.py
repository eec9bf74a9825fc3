"""Two jobs started by accident with one checkpoint folder (a script's default
`--checkpoint-dir`, a command copied with a new `--run-id`): one of them is refused
with one line, the other finishes with every checkpoint it recorded intact
(worker/checkpoint/folder_claim.py).

Before: both trained to the end and exited 0, each overwriting the other's step
directories (they save at the same step numbers), so a record's sha256 no longer
matched its checkpoint and a restart of that job fell back, silently losing work.
"""

from __future__ import annotations

import contextlib
import json
import re

import pytest

from elastic_runner.etcd.server import EmbeddedEtcd
from tests.e2e.harness import MLP, Job

pytestmark = pytest.mark.e2e

CLASH = "Two runs saving into one folder overwrite and delete each other's checkpoints"
LAUNCH_CLASH = "one run id launched twice against two etcds"


@pytest.mark.parametrize("launches", ["two run ids, one etcd", "one run id, two etcds"])
def test_a_second_job_saving_into_the_same_folder_is_refused_and_the_first_loses_nothing(
        etcd, tmp_path, launches):
    """The second case is the same command started twice, each against its own etcd (a
    node started without --rdzv-endpoints embeds one): one run id, two origins. Before the
    origin (rendezvous/protocol.origin_key) both exited 0 there too."""
    folder = tmp_path / "ckpt"
    with contextlib.ExitStack() as servers:
        if launches == "one run id, two etcds":
            endpoints = [etcd.endpoint, servers.enter_context(EmbeddedEtcd()).endpoint]
            run_ids, clash = ["train", "train"], LAUNCH_CLASH
        else:
            endpoints, run_ids, clash = [etcd.endpoint] * 2, ["first", "second"], CLASH
        jobs = {}
        for name, endpoint, run_id in zip(("first", "second"), endpoints, run_ids):
            (tmp_path / name).mkdir()
            jobs[name] = Job(endpoint, tmp_path / name, run_id=run_id, nproc=1, min_nodes=1,
                             max_nodes=1, script=MLP)
            jobs[name].script_args = (  # 1,024 steps: both run until the test hurries them
                "--checkpoint-dir", str(folder), "--every", "4", "--samples", "32768",
                "--global-batch", "32", "--step-time", "0.05",
                "--fast-file", str(jobs[name].fast_file))
        try:
            _race(jobs, folder, clash)
        finally:
            for job in jobs.values():
                job.stop_all()


def _race(jobs: dict[str, Job], folder, clash: str) -> None:
    """Start the second job once the first has a checkpoint; one must be refused."""
    jobs["first"].start("a", max_restarts=0)
    jobs["first"].wait_for(lambda: jobs["first"].recorded_step() >= 10, 90,
                           "the first job's checkpoint of step 10")
    jobs["second"].start("a", max_restarts=0)
    jobs["first"].wait_for(lambda: any(job.agents["a"].poll() is not None
                                       for job in jobs.values()), 120, "a job to end")
    for job in jobs.values():
        job.hurry()
    codes = {name: job.wait_exit("a", timeout=120) for name, job in jobs.items()}
    assert sorted(codes.values()) == [0, 6], codes
    loser = jobs[next(name for name, code in codes.items() if code == 6)]
    winner = jobs[next(name for name, code in codes.items() if code == 0)]
    kept = winner.checkpoint_record()
    assert kept["step"] == 1024  # the winner's last step, recorded
    manifest = json.loads((folder / "step-00001024" / "MANIFEST.json").read_text())
    assert manifest["sha256"] == kept["sha256"] and manifest["run_id"] == winner.run_id
    refused = [line for line in loser.agent_log("a").splitlines() if clash in line]
    assert refused, loser.agent_log("a")
    if winner.run_id == loser.run_id:  # then the origins tell the two launches apart
        assert f"of run {winner.run_id!r} (origin {manifest['run_origin']})" in refused[-1]
        assert f"this run ({loser.run_id!r} (origin " in refused[-1]
    else:
        assert f"of run {winner.run_id!r}, newer than" in refused[-1]
        assert f"this run ({loser.run_id!r})" in refused[-1]
    assert clash not in winner.agent_log("a")
    refused_step = int(re.search(r"so step (\d+) is not written", refused[-1]).group(1))
    for step_dir in folder.glob("step-*"):  # the loser wrote nothing from its refusal on
        owner = json.loads((step_dir / "MANIFEST.json").read_text())
        winners = (owner["run_id"], owner.get("run_origin")) == (winner.run_id,
                                                                  manifest["run_origin"])
        assert winners or int(step_dir.name[5:]) < refused_step, (step_dir.name, owner)


def test_a_node_local_checkpoint_folder_is_one_clear_error_at_the_first_resize(etcd, tmp_path):
    """`--checkpoint-dir ckpt` (the kind of relative default a script has) on two nodes
    that do not share it: rank 0 on node a records its checkpoints in a's folder; once a
    leaves, b's rank 0 cannot find the recorded step. Before, b skipped it as rot,
    retracted the record and trained again from step 0 (exit 0, every step lost)."""
    homes = {node: tmp_path / f"home-{node}" for node in ("a", "b")}
    for home in homes.values():
        home.mkdir()
    job = Job(etcd.endpoint, tmp_path, nproc=1, min_nodes=1, max_nodes=2, script=MLP,
              wrap={node: ["env", "-C", str(home)] for node, home in homes.items()},
              script_args=("--checkpoint-dir", "ckpt", "--every", "5", "--samples", "4096",
                           "--global-batch", "32", "--step-time", "0.05"))
    try:
        job.start("a")
        job.wait_for(lambda: "world size 1" in job.agent_log("a"), 60, "a training alone")
        job.start("b", max_restarts=1)
        job.wait_for(lambda: "world size 2" in job.agent_log("b"), 60, "a and b together")
        job.wait_for(lambda: job.recorded_step() >= 10, 90, "a checkpoint of step 10")
        job.terminate("a")
        assert job.wait_exit("a", timeout=60) == 0, job.agent_log("a")
        recorded = job.checkpoint_record()
        assert recorded["url"].startswith((homes["a"] / "ckpt").as_uri())
        assert job.wait_exit("b", timeout=120) == 6, job.agent_log("b")
        error = [line for line in job.agent_log("b").splitlines()
                 if line.startswith("elastic-run: error:")]
        assert len(error) == 1, job.agent_log("b")
        assert (f"step {recorded['step']} ({recorded['url']}), is not in the checkpoint folder "
                f"{(homes['b'] / 'ckpt').as_uri()}") in job.agent_log("b")
        assert "a node-local path works on one node only" in job.agent_log("b")
        assert job.checkpoint_record() == recorded  # not retracted
        assert not list((homes["b"] / "ckpt").glob("step-*"))  # b never trained from scratch
    finally:
        job.stop_all()
