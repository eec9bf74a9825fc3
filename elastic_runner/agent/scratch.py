"""An agent's private scratch folder, and the removal of folders whose agent died.

Why: the folder holds the worker contract's files (the notice marker, progress, the
etcd password file). An agent removes it on its way out, but a SIGKILLed or
OOM-killed agent cannot, and where a supervisor restarts the agent (systemd, a pod's
restart policy, a crash loop) the folders pile up in the temp directory, each with
a copy of the password. The test suite alone left about 50 per run.

Each folder names its owner: pid, the kernel's start time for that pid (a reused pid
is not the owner), the pid namespace and the boot. A starting agent removes the
folders, of its own user, whose owner is certainly gone: same boot and namespace and
no process with that pid and start time, or an earlier boot. A folder it cannot
judge (another namespace sharing the temp directory, no owner file yet, one from
before owner files) is left alone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from elastic_runner._process import stat_fields

log = logging.getLogger(__name__)

PREFIX = "elastic-run-agent-"
OWNER_FILE = "owner.json"


def create_scratch(parent: Path | None = None) -> Path:
    """A new folder (mkdtemp: mode 0700) that names this process as its owner."""
    path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
    partial = path / (OWNER_FILE + ".part")  # a sweep never reads half an owner
    partial.write_text(json.dumps(owner_of(os.getpid())))
    partial.rename(path / OWNER_FILE)
    return path


def remove_orphans(parent: Path | None = None) -> list[Path]:
    """Remove this user's scratch folders whose agent is gone; the folders removed."""
    parent = Path(parent or tempfile.gettempdir())
    removed = []
    for path in sorted(parent.glob(PREFIX + "*")):
        if _owner_gone(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d scratch folder(s) in %s left by agents that died",
                 len(removed), parent)
    return removed


class PasswordFile:
    """Workers read the etcd password from a file only this user can read, never from
    their environment (which /proc/PID/environ and crash reporters expose); it lives
    for one round. No password: no file."""

    def __init__(self, path: Path, password: str | None):
        self.path, self._password = path, password

    def write(self) -> None:
        if not self._password:
            return
        self.remove()
        handle = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(handle, "w") as out:
            out.write(self._password)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def owner_of(pid: int) -> dict | None:
    """What identifies process `pid` across pid reuse; None when it is gone."""
    fields = stat_fields(pid)
    if fields is None or fields[0] in (b"Z", b"X"):
        return None  # gone, or dead and not yet reaped by its parent
    return {"pid": pid, "start": int(fields[19]), "pidns": _pid_namespace(), "boot": _boot_id()}


def _owner_gone(path: Path) -> bool:
    try:
        if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
            return False
        owner = json.loads((path / OWNER_FILE).read_text())
        pid, boot, namespace = int(owner["pid"]), owner["boot"], owner["pidns"]
    except (OSError, ValueError, KeyError, TypeError):
        return False  # not ours to judge: being created, or from before owner files
    if boot != _boot_id():
        return True  # every process of an earlier boot is gone
    if namespace != _pid_namespace():
        return False  # its pid means another process here
    return owner_of(pid) != owner


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
