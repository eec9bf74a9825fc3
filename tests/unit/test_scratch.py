"""Scratch folders of dead agents are removed; everything else is left (agent/scratch.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_runner.agent import scratch

MADE_BY_A_CHILD = ("import sys; from pathlib import Path; "
                   "from elastic_runner.agent.scratch import create_scratch; "
                   "print(create_scratch(Path(sys.argv[1])))")


def folder_of_an_exited_process(parent: Path) -> Path:
    done = subprocess.run([sys.executable, "-c", MADE_BY_A_CHILD, str(parent)], check=True,
                          capture_output=True, text=True)
    return Path(done.stdout.strip())


def with_owner(parent: Path, name: str, owner) -> Path:
    path = parent / (scratch.PREFIX + name)
    path.mkdir()
    (path / scratch.OWNER_FILE).write_text(owner if isinstance(owner, str) else json.dumps(owner))
    return path


def test_ours_stays_and_a_dead_agents_goes_with_its_files(tmp_path):
    ours = scratch.create_scratch(tmp_path)
    dead = folder_of_an_exited_process(tmp_path)
    (dead / "etcd-password").write_text("s3cr3t")
    (dead / "progress").mkdir()
    assert oct(dead.stat().st_mode & 0o777) == "0o700"
    assert scratch.remove_orphans(tmp_path) == [dead]
    assert sorted(tmp_path.iterdir()) == [ours]


def test_a_live_process_other_than_us_keeps_its_folder(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        owner = scratch.owner_of(child.pid)
        kept = with_owner(tmp_path, "live", owner)
        assert scratch.remove_orphans(tmp_path) == []
        assert kept.exists()
    finally:
        child.kill()
        child.wait()
    assert scratch.remove_orphans(tmp_path) == [kept]


def test_an_unreaped_dead_process_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, still a zombie
        assert Path(f"/proc/{child.pid}").exists() and scratch.owner_of(child.pid) is None
    finally:
        child.wait()


def judged(tmp_path: Path, owner) -> bool:
    """Whether a sweep removes a folder with this owner file (and nothing else)."""
    path = with_owner(tmp_path, str(len(list(tmp_path.iterdir()))), owner)
    return scratch.remove_orphans(tmp_path) == [path]


def test_a_reused_pid_is_not_the_owner(tmp_path):
    me = scratch.owner_of(os.getpid())
    assert not judged(tmp_path, me)
    assert judged(tmp_path, {**me, "start": me["start"] - 1})


def test_an_earlier_boot_is_gone_another_pid_namespace_is_not_ours_to_judge(tmp_path):
    me = scratch.owner_of(os.getpid())
    assert judged(tmp_path, {**me, "boot": "another-boot"})
    assert not judged(tmp_path, {**me, "pidns": me["pidns"] + 1, "start": 1})


@pytest.mark.parametrize("owner", ["", "{half", "[]", "{}", '{"pid": "x", "boot": "", "pidns": 0}',
                                   '{"pid": null, "boot": "b", "pidns": 1}'])
def test_an_owner_file_that_cannot_be_read_leaves_the_folder(tmp_path, owner):
    assert not judged(tmp_path, owner)


def test_folders_without_an_owner_file_links_files_and_other_names_are_left(tmp_path):
    (tmp_path / (scratch.PREFIX + "old")).mkdir()  # from before owner files, or being made
    (tmp_path / (scratch.PREFIX + "file")).write_text("x")
    (tmp_path / "elsewhere").mkdir()
    target = folder_of_an_exited_process(tmp_path / "elsewhere")  # dead, but not in the sweep
    (tmp_path / (scratch.PREFIX + "link")).symlink_to(target)
    other = folder_of_an_exited_process(tmp_path)
    other.rename(tmp_path / "not-ours")
    assert scratch.remove_orphans(tmp_path) == []
    assert target.exists() and (tmp_path / "not-ours").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a folder to another user")
def test_another_users_folder_is_left(tmp_path):
    dead = folder_of_an_exited_process(tmp_path)
    os.chown(dead, 65534, 65534)
    assert scratch.remove_orphans(tmp_path) == []
    assert dead.exists()
