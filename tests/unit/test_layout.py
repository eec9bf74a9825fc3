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


def test_the_contract_and_the_cli_load_without_torch():
    probe = ("import sys, elastic_runner.cli.main, elastic_runner.contract; "
             "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "False", done.stderr
