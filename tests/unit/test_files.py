"""files.write_atomic: the old content or the new, never a mix; nothing left behind."""

from __future__ import annotations

import os
import signal
import stat
import threading

import pytest

from elastic_runner import files


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if files.TEMPORARY.search(p.name))


@pytest.mark.parametrize("durable", [False, True])
def test_replaces_the_content_whole(tmp_path, durable):
    target = tmp_path / "record.json"
    target.write_bytes(b"old")
    files.write_atomic(target, b"new content", durable=durable)
    assert target.read_bytes() == b"new content"
    files.write_atomic(str(target), b"", durable=durable)  # str paths and empty payloads too
    assert target.read_bytes() == b""
    assert leftovers(tmp_path) == []


def test_a_large_payload_arrives_in_full(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "CHUNK", 1000)  # many chunks without a large test payload
    data = bytes(range(256)) * 50
    files.write_atomic(tmp_path / "big", data, durable=True)
    assert (tmp_path / "big").read_bytes() == data


def test_a_failed_replace_keeps_the_old_content_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "record.json"
    target.write_bytes(b"old")

    def refuse(src, dst):
        raise OSError("replace refused")

    monkeypatch.setattr(files.os, "replace", refuse)
    with pytest.raises(OSError, match="replace refused"):
        files.write_atomic(target, b"new", durable=True)
    assert target.read_bytes() == b"old"
    assert leftovers(tmp_path) == []


def test_a_failed_write_keeps_the_old_content_and_no_temporary(tmp_path):
    target = tmp_path / "record.json"
    target.write_bytes(b"old")

    def half_then_fail(handle, data):
        handle.write(data[: len(data) // 2])
        raise KeyboardInterrupt  # BaseException too: an interrupted writer cleans up

    with pytest.raises(KeyboardInterrupt):
        files.write_atomic(target, b"new content", durable=False, write=half_then_fail)
    assert target.read_bytes() == b"old"
    assert leftovers(tmp_path) == []


def test_a_writer_killed_mid_write_leaves_the_old_content(tmp_path):
    """SIGKILL before the rename: no cleanup runs, yet readers still see the old file,
    and the temporary it left has a name TEMPORARY finds (for remove_temporaries)."""
    target = tmp_path / "record.json"
    target.write_bytes(b"old")
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: write half, tell the parent, wait to be killed
        try:
            os.close(ready_r)

            def half_then_wait(handle, data):
                handle.write(data[: len(data) // 2])
                handle.flush()
                os.write(ready_w, b"x")
                threading.Event().wait(60)

            files.write_atomic(target, b"new content", durable=True, write=half_then_wait)
        finally:
            os._exit(1)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"x"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready_r)
    assert target.read_bytes() == b"old"
    (left,) = leftovers(tmp_path)
    assert (tmp_path / left).read_bytes() == b"new c"


@pytest.mark.parametrize("durable", [False, True])
def test_durable_fsyncs_the_file_and_then_its_directory(tmp_path, monkeypatch, durable):
    synced: list[str] = []
    real_fsync = os.fsync

    def record(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", record)
    files.write_atomic(tmp_path / "record.json", b"new", durable=durable)
    assert synced == (["file", "dir"] if durable else [])


def test_a_directory_that_refuses_fsync_is_not_an_error(tmp_path, monkeypatch):
    """Some filesystems refuse fsync on a directory; the rename has happened by then."""
    real_fsync = os.fsync

    def refuse_dirs(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(22, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", refuse_dirs)
    files.write_atomic(tmp_path / "record.json", b"new", durable=True)
    assert (tmp_path / "record.json").read_bytes() == b"new"


def test_temporary_names_are_unique_and_recognised(tmp_path):
    names = {files.temporary_name(tmp_path / "x") for _ in range(100)}
    assert len(names) == 100
    assert all(files.TEMPORARY.search(n) and n.startswith(str(tmp_path / "x.tmp-")) for n in names)
