"""scripts/gpu_check.{sh,py} on this machine: the GPU check's whole flow as a dry run on
gloo (a real elastic-run, embedded etcd, a worker that fails a collective and re-forms
in place), and the clear refusal of the shell script where no GPU is visible."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_the_check_passes_end_to_end_on_gloo_through_the_shell_script(tmp_path):
    """Two workers, as on a machine with two GPUs: rank 1 loses its state at the
    failure and must receive rank 0's after re-forming. Run as on a GPU image whose own
    CUDA torch has no .venv of ours: the shell script with --python (one run of the
    whole check serves both; each costs seconds of worker starts)."""
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--python", sys.executable, "--cpu",
         "--nproc", "2", "--steps", "24", "--fail-at", "8", "--timeout", "90",
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    verdicts = [line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 14 and all(line.startswith("PASS") for line in verdicts)
    assert done.stdout.splitlines()[-1] == "gpu_check: 14 of 14 checks passed"
    sent = next(line for line in verdicts if "state sent to ranks behind" in line)
    received = int(sent.split("received ")[1].split(" bytes")[0])
    assert "1 rank(s)" in sent and received > 100_000  # the 256x256 MLP: 264 kB
    warm = next(line for line in verdicts if "waiting interpreter (--prewarm)" in line)
    assert "torch._dynamo imported" in warm and "not initialised" in warm


def test_the_shell_script_says_no_gpu_and_exits_2():
    try:
        import torch
        if torch.cuda.is_available():
            pytest.skip("a GPU is visible here")
    except ImportError:
        pass
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stderr.strip().startswith("gpu_check: cannot run here:")
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_shell_script_names_a_missing_interpreter():
    missing = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--python",
                              "no-such-python3"], capture_output=True, text=True, timeout=60,
                             cwd=ROOT)
    assert missing.returncode == 2
    assert missing.stderr.strip() == "gpu_check: cannot run here: no interpreter no-such-python3"
