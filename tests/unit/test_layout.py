"""What each entry point drags in: verbs that never talk to etcd must not load grpc."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["elastic_runner.cli.main", "elastic_runner.cli.deploy",
                                    "elastic_runner.cli.report", "elastic_runner.contract"])
def test_module_loads_without_grpc_or_the_etcd_client(module):
    probe = (f"import sys, {module}; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('grpc', 'pyetcd', 'tenacity') or m == 'elastic_runner.etcd.client'))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_contract_the_cli_and_the_agent_load_without_torch():
    """The agent runs on every node for the whole job: torch's import time and memory
    belong to the workers only."""
    probe = ("import sys, elastic_runner.cli.main, elastic_runner.contract, "
             "elastic_runner.agent.agent, elastic_runner.agent.launch; "
             "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "False", done.stderr
