"""etcd/tls.py names the cause when https:// meets a plain-text etcd, however that
etcd drops our TLS hello: a clean close, or a reset (3 % of handshakes against a real
etcd here, which once turned "does not speak TLS" into "unreachable" in a full run)."""

from __future__ import annotations

import socket
import struct
import threading

from elastic_runner.etcd.tls import tls_problem


def _server_that_resets() -> tuple[socket.socket, threading.Thread]:
    """Accepts one connection, reads a little of the hello, and resets it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(5)  # part of the hello only: the rest stays unread
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # with linger 0: RST, as the kernel does with unread data

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def test_a_reset_at_the_hello_says_the_server_does_not_speak_tls():
    listener, thread = _server_that_resets()
    try:
        problem = tls_problem("127.0.0.1", listener.getsockname()[1], None, None, None, 2.0)
    finally:
        thread.join(5)
        listener.close()
    assert problem is not None and "does not speak TLS" in problem, problem


def test_every_handshake_with_a_plain_etcd_names_the_cause(etcd):
    problems = [tls_problem("127.0.0.1", etcd.client_port, None, None, None, 2.0)
                for _ in range(60)]
    assert all(p is not None and "does not speak TLS" in p for p in problems), \
        sorted({str(p) for p in problems})


def test_a_closed_port_is_no_tls_problem():
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    assert tls_problem("127.0.0.1", port, None, None, None, 1.0) is None
