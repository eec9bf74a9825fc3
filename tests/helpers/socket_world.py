"""A torch-free stand-in for the probe's gloo all-reduce, over plain TCP.

Why: most e2e tests check what the agents decide (who is in which round, ranks, world
sizes, restarts, exit codes), not torch. Their probe's `import torch` and gloo set-up
were 1.6 s of CPU per worker start, about a fifth of the whole suite's CPU on 2 cores.
This keeps the part of the contract those tests rely on: rank 0 listens on
MASTER_PORT (on every interface, as torch's TCPStore does) and every other rank of
WORLD_SIZE connects to MASTER_ADDR:MASTER_PORT, so a step completes only when the
whole world of the round is present. A peer that dies ends the others' next step with
an error, as a broken gloo collective does; a silent one, after `timeout_s`.
The torch path stays in the tests about torch (core scenarios, prewarm, torchrun).
"""

from __future__ import annotations

import os
import socket
import time

CONNECT_RETRY_S = 0.05


class SocketWorld:
    def __init__(self, rank: int, world: int, addr: str, port: int, timeout_s: float):
        self.rank, self.world = rank, world
        self.peers: list[socket.socket] = []
        self.lines: list = []  # one buffered reader per peer: a step's line may follow its rank's
        if world == 1:
            return
        if rank == 0:
            self._accept_all(port, timeout_s)
        else:
            self.peers = [_connect(addr, port, rank, timeout_s)]
        for peer in self.peers:
            peer.settimeout(timeout_s)
        self.lines = self.lines or [peer.makefile("rb") for peer in self.peers]
        # Copies never closed: a connection ends when this process does, as a crashed
        # worker's would, not when an exception unwinds past these sockets before the
        # interpreter's shutdown (then a peer would end before the failing rank did).
        self._until_exit = [os.dup(peer.fileno()) for peer in self.peers]

    def all_reduce_ones(self) -> int:
        """The world's sum of 1 from each rank: the world size, once every rank is here."""
        if self.world == 1:
            return 1
        if self.rank == 0:
            total = 1 + sum(int(_read_line(lines)) for lines in self.lines)
            for peer in self.peers:
                peer.sendall(f"{total}\n".encode())
            return total
        self.peers[0].sendall(b"1\n")
        return int(_read_line(self.lines[0]))

    def close(self) -> None:
        for peer in self.peers:
            peer.close()

    def _accept_all(self, port: int, timeout_s: float) -> None:
        server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True) \
            if socket.has_dualstack_ipv6() else socket.create_server(("", port))
        server.settimeout(timeout_s)
        with server:
            by_rank: dict[int, tuple] = {}
            while len(by_rank) < self.world - 1:
                peer, _ = server.accept()
                peer.settimeout(timeout_s)
                lines = peer.makefile("rb")
                rank = int(_read_line(lines))
                if rank in by_rank or not 0 < rank < self.world:
                    raise ConnectionError(f"rank {rank} connected twice or is not of a "
                                          f"world of {self.world}")
                by_rank[rank] = (peer, lines)
        self.peers = [by_rank[rank][0] for rank in sorted(by_rank)]
        self.lines = [by_rank[rank][1] for rank in sorted(by_rank)]


def _connect(addr: str, port: int, rank: int, timeout_s: float) -> socket.socket:
    """Rank 0 may start later than this rank: retry a refused connection until the bound."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            peer = socket.create_connection((addr, port), timeout=timeout_s)
            peer.sendall(f"{rank}\n".encode())
            return peer
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(CONNECT_RETRY_S)


def _read_line(lines) -> str:
    line = lines.readline()
    if not line.endswith(b"\n"):
        # gloo's words for it (failures.lost_a_peer reads them): "... Connection closed by
        # peer [addr]:port. This is typically caused by a remote worker crashing."
        raise ConnectionError("Connection closed by peer: a peer of the round closed its "
                              "connection (socket_world)")
    return line.decode().strip()
