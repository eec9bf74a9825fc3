"""bench/etcd_profile.py: etcd's Go CPU profiles read without Go, split by category.

rendezvous_scale --etcd-profile leans on this to say where etcd's CPU goes in a round;
a decoder that misread profile.proto would put every sample under "other" or none."""

from __future__ import annotations

import gzip
import importlib.util
import sys
import threading
import time
from pathlib import Path

import pytest

from elastic_runner.config import EtcdConfig
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.etcd.server import EmbeddedEtcd
from tests.conftest import available_etcd_binaries

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "etcd_profile.py"
_spec = importlib.util.spec_from_file_location("etcd_profile", SCRIPT)
ep = importlib.util.module_from_spec(_spec)
sys.modules["etcd_profile"] = ep
_spec.loader.exec_module(ep)

STORAGE, SCHEDULER = ep.CATEGORIES[0][0], ep.CATEGORIES[4][0]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, value) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _packed(values: list[int]) -> bytes:
    return b"".join(_varint(v) for v in values)


def synthetic_profile(tmp_path: Path) -> Path:
    """Two stacks as Go writes them: 10 ms in a put under the apply loop (location ids
    packed), 30 ms parked in the scheduler (ids one field each, as older writers do)."""
    strings = ["", "main", "go.etcd.io/etcd/server/v3/mvcc.(*store).Put",
               "runtime.findrunnable", "runtime.futex"]
    functions = [_field(5, _field(1, fid) + _field(2, fid)) for fid in range(1, 5)]
    locations = [_field(4, _field(1, lid) + _field(4, _field(1, lid))) for lid in range(1, 5)]
    samples = [
        _field(2, _field(1, _packed([2, 1])) + _field(2, _packed([1, 10_000_000]))),
        _field(2, _field(1, 4) + _field(1, 3) + _field(1, 1) + _field(2, 3) + _field(2, 30_000_000)),
    ]
    body = b"".join(samples + locations + functions + [_field(6, s.encode()) for s in strings])
    path = tmp_path / "synthetic.pb.gz"
    path.write_bytes(gzip.compress(body))
    return path


def test_stacks_and_shares_of_a_hand_built_profile(tmp_path):
    path = synthetic_profile(tmp_path)
    stacks = ep.read_stacks(path)
    assert stacks == [(["go.etcd.io/etcd/server/v3/mvcc.(*store).Put", "main"], 10_000_000),
                      (["runtime.futex", "runtime.findrunnable", "main"], 30_000_000)]
    result = ep.shares([path])
    assert result["sampled_cpu_s"] == pytest.approx(0.04)
    assert result["shares"] == {SCHEDULER: 0.75, STORAGE: 0.25}


def test_a_stack_is_counted_once_under_its_first_category():
    # The apply loop runs under the scheduler's frames too: storage wins.
    assert ep.category_of(["runtime.mcall", "etcdserver.(*raftNode).start.func1"]) == STORAGE
    assert ep.category_of(["runtime.memmove"]) == ep.OTHER


@pytest.mark.parametrize("binary", available_etcd_binaries(),
                         ids=lambda b: "etcd-" + Path(b).parent.name)
def test_windows_of_a_real_etcd_under_writes(tmp_path, binary):
    """A real member with --enable-pprof, written to for 2.5 s or more: the windows that overlap
    the writes hold samples, its storage work is among them, and next to nothing is
    left uncategorised (etcd 3.4 and 3.5 name their packages differently)."""
    with EmbeddedEtcd(binary=binary, extra_args=("--enable-pprof",)) as etcd:
        client = EtcdClient(EtcdConfig((etcd.endpoint,), timeout_s=5.0, retry_deadline_s=10.0))
        stop = threading.Event()

        def write() -> None:
            count = 0
            while not stop.is_set():
                client.put(f"/profile-test/{count % 50}", b"x" * 200)
                count += 1

        with ep.WindowProfiler(etcd.endpoint, tmp_path / "windows") as profiler:
            writers = [threading.Thread(target=write) for _ in range(4)]
            began = time.time()
            for thread in writers:
                thread.start()
            # At least 2.5 s, and until three windows have ended during the writes: a
            # loaded machine stretches each 1 s profile (CI once got only two in 2.5 s).
            time.sleep(2.5)
            while _windows_ended_since(profiler, began) < 3 and time.time() < began + 30:
                time.sleep(0.1)
            stop.set()
            for thread in writers:
                thread.join()
            ended = time.time()
            result = ep.phase_shares([profiler], began, ended)
            assert len(profiler.overlapping(began, ended)) >= 3
        client.close()
    assert result["sampled_cpu_s"] > 0
    assert sum(result["shares"].values()) == pytest.approx(1.0, abs=0.01)
    assert result["shares"].get(STORAGE, 0) > 0
    assert result["shares"].get(ep.OTHER, 0) < 0.2, result


def _windows_ended_since(profiler: ep.WindowProfiler, since: float) -> int:
    return sum(1 for _, ended, _ in list(profiler.windows) if ended > since)
