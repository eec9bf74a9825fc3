"""Where etcd's CPU goes, from its own Go CPU profiles (etcd --enable-pprof).

Issue 17's last open goal is etcd's CPU for the start round. /proc says how much etcd
spent, not on what; Go's profiler does. `WindowProfiler` takes back-to-back 1 s CPU
profiles from `/debug/pprof/profile` (Go's shortest window) and keeps each with its
wall-clock span, so a bench can add up the windows of one phase. `shares()` reads
the profiles (gzipped profile.proto, decoded here: the repository has no Go tool
chain) and splits the samples into the categories below by the frames on the stack,
first match wins, so a sample is counted once.

Sampling is 100 Hz: a 1 s phase at 100 % of a core is about 100 samples, so shares
are good to a few percent, and a window edge can add up to 1 s of idle etcd (0.01-0.02
core). The samples also add up to less than /proc's CPU (0.81 of 1.41 s in a start at
N = 1,024): etcd 3.5.1 is built with a Go whose process-wide profiling timer drops
ticks while several threads run. Shares, not seconds, are what to read; multiply
them by the phase's CPU from /proc.

    .venv/bin/python bench/etcd_profile.py profiles/*.pb.gz     # shares of saved windows
"""

from __future__ import annotations

import gzip
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

# First match wins, in this order: storage and consensus before the request layer
# that calls into them, and the request layer before the transport beneath it.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Package paths as both etcd 3.4 (go.etcd.io/etcd/mvcc) and 3.5
    # (go.etcd.io/etcd/server/v3/mvcc, go.etcd.io/etcd/raft/v3) name them.
    ("etcd storage, raft, WAL, apply, peers", (
        "/mvcc", "/lease.", "/raft", "/wal.",
        "etcdserver.(*applier", "etcdserver.(*authApplier", "etcdserver.(*quotaApplier",
        "etcdserver.(*EtcdServer).apply", "etcdserver.(*raftNode", "bbolt")),
    ("etcd request layer (v3rpc, interceptors, metrics)", (
        "etcdserver/api/v3rpc", "go-grpc-prometheus", "go-grpc-middleware",
        "client_golang/prometheus", "etcdserver.(*EtcdServer)")),
    ("gRPC and HTTP/2 transport", ("google.golang.org/grpc", "golang.org/x/net/http2", "cmux")),
    ("Go garbage collector", ("runtime.gcBgMarkWorker", "runtime.gcAssist", "runtime.scanobject",
                              "runtime.markroot", "runtime.bgsweep", "runtime.bgscavenge")),
    ("Go scheduler (park, wake, idle spin)", ("runtime.findrunnable", "runtime.schedule",
                                              "runtime.park_m", "runtime.mcall", "runtime.sysmon")),
)
OTHER = "other"


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _fields(data: bytes):
    """(field number, wire type, value) of one protobuf message, without a schema."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 2:
            size, at = _varint(data, at)
            value, at = data[at:at + size], at + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, at = data[at:at + size], at + size
        else:
            raise ValueError(f"protobuf wire type {wire} is not in profile.proto")
        yield number, wire, value


def _ints(value, wire: int) -> list[int]:
    """A repeated integer field, packed (wire 2) or not."""
    if wire == 0:
        return [value]
    out, at = [], 0
    while at < len(value):
        item, at = _varint(value, at)
        out.append(item)
    return out


def read_stacks(path: Path) -> list[tuple[list[str], int]]:
    """Each sample of a pprof CPU profile as (function names leaf first, CPU ns).

    profile.proto: Profile.sample = 2 (location_id = 1, value = 2; CPU ns is the
    last value), location = 4 (id = 1, line = 4 with function_id = 1), function = 5
    (id = 1, name = 2 as a string-table index), string_table = 6."""
    data = gzip.decompress(path.read_bytes())
    samples, locations, functions, strings = [], {}, {}, []
    for number, wire, value in _fields(data):
        if number == 2:
            ids, values = [], []
            for inner, inner_wire, item in _fields(value):
                if inner == 1:
                    ids += _ints(item, inner_wire)
                elif inner == 2:
                    values += _ints(item, inner_wire)
            samples.append((ids, values[-1] if values else 0))
        elif number == 4:
            fields = list(_fields(value))
            lid = next((item for inner, _, item in fields if inner == 1), 0)
            locations[lid] = [item2 for inner, _, item in fields if inner == 4
                              for inner2, _, item2 in _fields(item) if inner2 == 1]
        elif number == 5:
            fields = {inner: item for inner, _, item in _fields(value) if inner in (1, 2)}
            functions[fields.get(1, 0)] = fields.get(2, 0)
        elif number == 6:
            strings.append(value.decode("utf-8", "replace"))
    return [([strings[functions[fid]] for lid in ids for fid in locations.get(lid, [])], ns)
            for ids, ns in samples]


def category_of(stack: list[str]) -> str:
    for name, patterns in CATEGORIES:
        if any(pattern in frame for frame in stack for pattern in patterns):
            return name
    return OTHER


def shares(paths) -> dict:
    """CPU seconds sampled in `paths`, and each category's share of them."""
    spent: Counter = Counter()
    for path in paths:
        for stack, ns in read_stacks(Path(path)):
            spent[category_of(stack)] += ns
    total = sum(spent.values())
    return {"sampled_cpu_s": total / 1e9,
            "shares": {name: round(ns / total, 3) for name, ns in spent.most_common()}
            if total else {}}


class WindowProfiler:
    """Back-to-back 1 s CPU profiles of one etcd member while the bench runs."""

    def __init__(self, endpoint: str, folder: Path):
        self.endpoint, self.folder = endpoint, folder
        self.windows: list[tuple[float, float, Path]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "WindowProfiler":
        self.folder.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        url = f"{self.endpoint}/debug/pprof/profile?seconds=1"
        while not self._stop.is_set():
            began = time.time()
            try:
                data = urllib.request.urlopen(url, timeout=30).read()
            except OSError:
                return  # etcd has stopped: the bench is over
            path = self.folder / f"window-{len(self.windows):05d}.pb.gz"
            path.write_bytes(data)
            self.windows.append((began, time.time(), path))

    def overlapping(self, start: float, end: float) -> list[Path]:
        """The saved windows that overlap [start, end], once the one running at `end`
        has been saved (a window is written only when its second is over)."""
        deadline = time.time() + 5.0
        while self._thread.is_alive() and time.time() < deadline and \
                not any(ended >= end for _, ended, _ in list(self.windows)):
            time.sleep(0.05)
        return [path for began, ended, path in list(self.windows)
                if ended > start and began < end]


def phase_shares(profilers: list[WindowProfiler], start: float, end: float) -> dict:
    """The categories of every member's windows that overlap [start, end]."""
    return shares(path for profiler in profilers for path in profiler.overlapping(start, end))


def main() -> None:
    result = shares(sys.argv[1:])
    print(f"{result['sampled_cpu_s']:.2f} s of etcd CPU sampled")
    for name, share in result["shares"].items():
        print(f"{100 * share:5.1f} %  {name}")


if __name__ == "__main__":
    main()
