"""Name the TLS cause when etcd cannot be reached over https.

Why: gRPC reports a failed handshake (wrong CA, a client certificate the server
refuses, https:// to a plain-text etcd) as plain "unavailable", and the etcd
library drops even that detail, so the user saw "etcd unreachable" for a
certificate problem. One handshake with Python's ssl module, with the same files,
recovers the reason; it runs only after a connection has already failed.
"""

from __future__ import annotations

import socket
import ssl

# A server that refuses our client certificate says so in an alert that TLS 1.3
# delivers after the handshake; wait this long for it.
ALERT_WAIT_S = 0.5
# The handshake runs only after a connection already failed, to name the cause; on a
# machine so loaded that --etcd-timeout 1 ran out, a second more costs little and
# keeps "does not speak TLS" from turning into "unreachable" (seen once in a full
# test run on 2 cores).
MIN_HANDSHAKE_S = 3.0


NOT_TLS = "the server does not speak TLS; use http:// for a plain-text etcd"


def tls_problem(host: str, port: int, cacert: str | None, cert: str | None,
                key: str | None, timeout_s: float) -> str | None:
    """The TLS reason a connection to host:port fails, or None if TLS is not the cause."""
    context = ssl.create_default_context(cafile=cacert)
    try:
        if cert and key:
            context.load_cert_chain(cert, key)
        with socket.create_connection((host, port),
                                      timeout=max(timeout_s, MIN_HANDSHAKE_S)) as raw:
            with context.wrap_socket(raw, server_hostname=host) as tls:
                tls.settimeout(ALERT_WAIT_S)
                try:
                    tls.recv(1)
                except (TimeoutError, socket.timeout):
                    pass
    except ssl.SSLCertVerificationError as exc:
        return f"the server's certificate does not verify ({exc.verify_message}); check --etcd-cacert"
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG",
                      "HTTP_REQUEST", "UNEXPECTED_EOF_WHILE_READING"):
            return f"handshake failed ({reason}): {NOT_TLS}"
        return f"handshake failed ({reason}); check --etcd-cert, --etcd-key and --etcd-cacert"
    except ConnectionResetError:
        # A plain-text etcd drops a TLS hello it cannot parse, and with the hello still
        # unread the kernel resets the connection instead of closing it: 9 handshakes
        # in 300 here (the rest end in UNEXPECTED_EOF_WHILE_READING above). A refused
        # or unreachable port raises other errors.
        return f"the connection was reset at the TLS handshake: {NOT_TLS}"
    except OSError:
        return None  # not reachable at all: not a TLS problem
    return None
