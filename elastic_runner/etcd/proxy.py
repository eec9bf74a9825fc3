"""etcd's gRPC proxy (`etcd grpc-proxy start`) on a free loopback port, for the tests
and the rendezvous bench; in production it is started beside the agents (deploy/).

Why a proxy at all: every agent watches the run's common range (notice/*, round,
round/*), so at N agents etcd sends each round-key write N times, and holds N
connections and N keep-alive streams. The proxy coalesces watchers of one range into
a single etcd watcher and fans the events out itself, and carries its clients'
requests over its own connection. Proxies are stateless, so a fleet runs as many as
it needs (one per rack, say) and their work stays off the one etcd cluster every
node shares. What it changes for us: keep-alives are answered on the proxy's own
schedule (etcd/keepalive.py), and a frozen client's lease lives up to one TTL longer
(the proxy keeps refreshing until a TTL passes without a request from it).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Sequence

from elastic_runner._process import bound_to_parent, stop_process
from elastic_runner.etcd.server import find_etcd_binary, free_port, wait_ready


class EtcdGrpcProxy:
    """One proxy process in front of etcd, stopped by its PID. `etcd_endpoints`: one
    member's URL, or every member's (a sequence), as a proxy in production lists the
    whole cluster and fails over between its members."""

    def __init__(self, etcd_endpoints: str | Sequence[str], binary: str | None = None,
                 startup_deadline_s: float = 10.0):
        self.binary = find_etcd_binary(binary)
        self.port = free_port()
        self.etcd_endpoints = ((etcd_endpoints,) if isinstance(etcd_endpoints, str)
                               else tuple(etcd_endpoints))
        self.startup_deadline_s = startup_deadline_s
        self.data_dir = Path(tempfile.mkdtemp(prefix="elastic-run-grpc-proxy-"))
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "proxy.log"

    def command(self) -> list[str]:
        targets = ",".join(url.split("://", 1)[-1] for url in self.etcd_endpoints)
        return [self.binary, "grpc-proxy", "start", f"--endpoints={targets}",
                f"--listen-addr=127.0.0.1:{self.port}",
                f"--advertise-client-url=127.0.0.1:{self.port}",
                f"--data-dir={self.data_dir / 'data'}"]

    def start(self) -> "EtcdGrpcProxy":
        on_main = threading.current_thread() is threading.main_thread()  # server.py: why
        argv = bound_to_parent(self.command()) if on_main else self.command()
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                argv, stdout=log_file, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_listening()
        return self

    def _wait_listening(self) -> None:
        wait_ready(self.process, self._listening, self.startup_deadline_s, "etcd grpc-proxy",
                   "listening", self.log_path, self.stop)

    def _listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            return True
        except OSError:
            return False

    def stop(self, timeout_s: float = 5.0) -> None:
        stop_process(self.process, timeout_s)

    def __enter__(self) -> "EtcdGrpcProxy":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
