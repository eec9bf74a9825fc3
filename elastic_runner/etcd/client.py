"""EtcdClient: the only module that knows which etcd library we use.

Why a facade: the library (`pyetcd`, python-etcd3's API) has no per-call
deadline unless the client carries one, no bounded retry, no resumable watch
and raises its own or raw gRPC exceptions. Everything above this module sees
plain dataclasses, one retry policy bounded in time, and `EtcdError` subclasses
that say which endpoints failed and what to do.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Sequence

# The agent forks workers while gRPC threads run; gRPC's fork handlers only log
# noise there, and the children exec at once without touching gRPC.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc  # noqa: E402
import pyetcd  # noqa: E402
import pyetcd.exceptions as etcd_exc  # noqa: E402
from pyetcd import etcdrpc  # noqa: E402
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from elastic_runner.config import EtcdConfig
from elastic_runner.errors import (
    ConfigError, EtcdAuthError, EtcdError, EtcdFull, EtcdUnavailable, LeaseNotFound,
)
from elastic_runner.etcd.endpoints import parse_endpoint
from elastic_runner.etcd.keepalive import KeepAliveStream, StreamEnded
from elastic_runner.etcd.tls import tls_problem
from elastic_runner.etcd.watch import Compacted, PrefixWatch
from elastic_runner.etcd.values import (
    Compare, Delete, Get, KeyValue, Nested, Put, Read, TxnResult, WatchEvent,
    key_missing, mod_revision_is, prefix_empty,
)

# The values are re-exported: callers import everything etcd from here.
__all__ = ["EtcdClient", "PrefixWatch", "Compare", "Delete", "Get", "KeyValue", "Nested",
           "Put", "Read", "TxnResult", "WatchEvent", "key_missing", "mod_revision_is",
           "prefix_empty"]

log = logging.getLogger(__name__)

# gRPC's default reconnect backoff grows to 120 s; after an etcd restart we must
# reconnect well inside a lease TTL, so cap it at one second.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Not gRPC's 4 MiB (etcd's Go client: 2 GiB): a deputy reads every round's plan,
    # 8 KB each at 1,024 nodes, past 4 MiB after about 480 rounds.
    ("grpc.max_receive_message_length", 2**31 - 1),
]
_TRANSIENT_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class EtcdClient:
    """A synchronous etcd v3 client with deadlines, bounded retries and typed errors."""

    def __init__(self, config: EtcdConfig):
        self._config = config
        self._endpoint_text = ",".join(config.endpoints)
        self._lock = threading.Lock()
        self._client = self._connect()
        self._keepalive = KeepAliveStream(_open_keepalive_stream, _keepalive_request)

    # ---- connection -------------------------------------------------------------
    def _connect(self) -> pyetcd.MultiEndpointEtcd3Client:
        endpoints = []
        for url in self._config.endpoints:
            host, port, tls = parse_endpoint(url)
            creds = self._credentials() if (tls or self._config.cacert) else None
            endpoints.append(
                pyetcd.Endpoint(host, port, secure=creds is not None, creds=creds,
                                time_retry=0.5, opts=_CHANNEL_OPTIONS)
            )
        try:
            client = self._retrying(
                lambda: pyetcd.MultiEndpointEtcd3Client(
                    endpoints=endpoints,
                    timeout=self._config.timeout_s,
                    user=self._config.user,
                    password=self._config.password,
                    failover=True,
                )
            )
        except EtcdError:
            raise
        except Exception as exc:  # library raises bare Exception for half-given credentials
            raise EtcdError(f"cannot set up the etcd client for {self._endpoint_text}: {exc}") from exc
        if not any(ep.secure for ep in endpoints):
            # gRPC refuses call credentials on a plaintext channel; the auth token
            # still travels as request metadata, which is what etcd reads.
            client.call_credentials = None
        return client

    def _credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            try:
                with open(path, "rb") as handle:
                    return handle.read()
            except OSError as exc:
                raise ConfigError(f"cannot read TLS file {path}: {exc.strerror}") from exc

        return grpc.ssl_channel_credentials(
            read(self._config.cacert), read(self._config.key), read(self._config.cert)
        )

    def _reauthenticate(self) -> None:
        """etcd's simple auth tokens expire (5 min by default): log in again."""
        log.debug("etcd auth token expired; authenticating again")
        with self._lock:
            stale, self._client = self._client, self._connect()
        _close_quietly(stale)

    def close(self) -> None:
        self._keepalive.close()
        _close_quietly(self._client)

    # ---- error handling ---------------------------------------------------------
    def _translate(self, exc: BaseException, what: str) -> EtcdError:
        code = exc.code() if isinstance(exc, grpc.RpcError) else None
        details = exc.details() if isinstance(exc, grpc.RpcError) else ""
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or \
                "authentication failed" in (details or ""):
            return EtcdAuthError(
                f"etcd at {self._endpoint_text} refused {what}: {exc.details()} "
                "(check --etcd-user and the password file)"
            )
        if isinstance(exc, (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError,
                            etcd_exc.NoServerAvailableError)) or code in _TRANSIENT_CODES:
            tls = self._tls_problem()
            if tls:
                return EtcdError(f"TLS to etcd at {tls[0]} failed: {tls[1]}")
            return EtcdUnavailable(
                f"etcd unreachable at {self._endpoint_text} ({what} failed for "
                f"{self._config.retry_deadline_s:g} s): check --rdzv-endpoints, that etcd runs, "
                "and TLS flags"
            )
        detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc) or type(exc).__name__
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in (detail or ""):
            # By code and text: NOT_FOUND also answers for other missing things (members).
            return LeaseNotFound(f"etcd at {self._endpoint_text} no longer has the lease "
                                 f"named in {what}: {detail}")
        if "database space exceeded" in (detail or ""):  # its NOSPACE alarm: writes refused
            return EtcdFull(f"etcd at {self._endpoint_text} is full and refused {what} ({detail}): "
                             "compact and defragment it, then `etcdctl alarm disarm`; turn on "
                             "its --auto-compaction-retention or raise --quota-backend-bytes")
        return EtcdError(f"etcd at {self._endpoint_text} answered {what} with an error: {detail}")

    def _tls_problem(self) -> tuple[str, str] | None:
        """(endpoint, cause) when a TLS endpoint fails its handshake; see etcd/tls.py."""
        for url in self._config.endpoints:
            host, port, tls = parse_endpoint(url)
            if tls or self._config.cacert:
                problem = tls_problem(host, port, self._config.cacert, self._config.cert,
                                      self._config.key, self._config.timeout_s)
                if problem:
                    return url, problem
        return None

    def _retrying(self, call: Callable, what: str = "the request", deadline: float | None = None):
        """Run `call`, retrying transient failures until the deadline, then raise typed."""
        retryer = Retrying(
            retry=retry_if_exception_type(_Transient),
            stop=stop_after_delay(self._config.retry_deadline_s if deadline is None else deadline),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            reraise=True,
        )
        try:
            for attempt in retryer:
                with attempt:
                    try:
                        return call()
                    except (grpc.RpcError, etcd_exc.Etcd3Exception) as exc:
                        if _token_expired(exc) and self._config.user:
                            self._reauthenticate()
                            raise _Transient(exc) from exc
                        if _is_transient(exc):
                            raise _Transient(exc) from exc
                        raise self._translate(exc, what) from exc
        except _Transient as wrapped:
            raise self._translate(wrapped.cause, what) from wrapped.cause
        raise AssertionError("unreachable")

    # ---- key/value --------------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        response = self._retrying(lambda: self._client.get_response(key), f"get {key}")
        return _to_kv(response.kvs[0]) if response.count else None

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Return the keys under `prefix` (sorted by key) and the store revision read at."""
        response = self._retrying(
            lambda: self._client.get_prefix_response(prefix, sort_order="ascend"),
            f"get {prefix}*",
        )
        return [_to_kv(kv) for kv in response.kvs], response.header.revision

    def get_range(self, start: str, end: str) -> tuple[list[KeyValue], int]:
        """Return the keys in [start, end) (sorted by key) and the store revision read at."""
        response = self._retrying(
            lambda: self._client.get_range_response(start, end, sort_order="ascend"),
            f"get [{start}, {end})",
        )
        return [_to_kv(kv) for kv in response.kvs], response.header.revision

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        response = self._retrying(lambda: self._client.put(key, value, lease=lease), f"put {key}")
        return response.header.revision

    def count_prefix(self, prefix: str) -> int:
        response = self._retrying(
            lambda: self._client.get_prefix_response(prefix, count_only=True), f"count {prefix}*")
        return response.count

    def txn(self, compares: Sequence[Compare], success: Sequence[Put | Delete | Get | Nested],
            failure: Sequence[Put | Delete | Get | Nested] = ()) -> TxnResult:
        request = _txn_message(compares, success, failure)
        response = self._retrying(
            lambda: self._client.kvstub.Txn(
                request, self._config.timeout_s,
                credentials=self._client.call_credentials, metadata=self._client.metadata,
            ),
            "a transaction",
        )
        reads = tuple(Read(r.response_range.count, tuple(_to_kv(kv) for kv in r.response_range.kvs))
                      for r in response.responses if r.WhichOneof("response") == "response_range")
        return TxnResult(response.succeeded, response.header.revision, reads)

    def create_if_absent(self, key: str, value: bytes, lease: int | None = None) -> bool:
        return self.txn([key_missing(key)], [Put(key, value, lease)]).succeeded

    def server_version(self, retry_deadline_s: float | None = None) -> str:
        """Ask the member for its version; proves the endpoint really is etcd."""
        response = self._retrying(lambda: self._client.status(), "a status request",
                                  deadline=retry_deadline_s)
        return response.version

    def leader_endpoint(self) -> str | None:
        """The client URL of the cluster's current leader (None while electing)."""
        status = self._retrying(lambda: self._client.status(), "a status request")
        return status.leader.client_urls[0] if status.leader and status.leader.client_urls \
            else None

    # ---- leases -----------------------------------------------------------------
    def grant_lease(self, ttl_s: int) -> int:
        return self._retrying(lambda: self._client.lease(ttl_s), "a lease grant").id

    def refresh_lease(self, lease_id: int, deadline_s: float) -> int:
        """Refresh once; return the remaining TTL (<= 0 when the lease is gone). On the
        client's long-lived keep-alive stream (keepalive.py says why), given half the
        deadline; failing that, on a stream of its own with what is left."""
        started = time.monotonic()
        ttl = self._keepalive.refresh(lease_id, deadline_s / 2, self._client)
        if ttl is not None:
            return ttl
        deadline_s -= time.monotonic() - started
        end = time.monotonic() + deadline_s

        def one_shot() -> int:
            try:
                ttl = self._keepalive.one_shot(lease_id, end - time.monotonic(), self._client)
            except grpc.RpcError as exc:
                # As the library's own calls do: an endpoint that is down is marked failed,
                # so the retry (and every later call) goes to the next one.
                self._client._manage_grpc_errors(exc)
                raise
            except ValueError as exc:  # grpc: "Cannot invoke RPC: Channel closed!"
                raise EtcdUnavailable(f"lease keep-alive after the client was closed ({exc})") \
                    from exc
            if ttl is None:
                raise EtcdUnavailable(f"etcd at {self._endpoint_text} did not answer a lease "
                                      f"keep-alive within {deadline_s:.1f} s")
            return ttl
        try:
            return self._retrying(one_shot, "a lease keep-alive", deadline_s)
        except StreamEnded as exc:
            # Says nothing about the lease: a failed refresh, not an expiry.
            raise EtcdUnavailable(f"etcd at {self._endpoint_text} closed a lease keep-alive "
                                  "without answering") from exc

    def revoke_lease(self, lease_id: int, deadline_s: float | None = None) -> None:
        try:
            self._retrying(lambda: self._client.revoke_lease(lease_id), "a lease revoke", deadline_s)
        except LeaseNotFound:
            pass  # expired or revoked already: what a revoke wants

    def lease_remaining(self, lease_id: int) -> int:
        return self._retrying(lambda: self._client.get_lease_info(lease_id), "a lease query").TTL

    # ---- watches ----------------------------------------------------------------
    def watch_prefix(self, prefix: str, start_revision: int,
                     on_events: Callable[[list[WatchEvent]], None],
                     on_compacted: Callable[[int], None] | None = None) -> "PrefixWatch":
        """`on_compacted(revision)`: see PrefixWatch; the caller must read again."""
        return self.watch_range(prefix, None, start_revision, on_events, on_compacted)

    def watch_range(self, start: str, end: str | None, start_revision: int,
                    on_events: Callable[[list[WatchEvent]], None],
                    on_compacted: Callable[[int], None] | None = None) -> "PrefixWatch":
        """Watch the keys in [start, end): several neighbouring keys on one stream
        (end None: every key starting with `start`)."""
        watch = PrefixWatch(self._open_watch, _read_delivery, start, start_revision, on_events,
                            end, on_compacted)
        watch.start()
        return watch

    def _open_watch(self, start: str, end: str | None, revision: int,
                    deliver: Callable) -> Callable[[], None]:
        """watch.py's OpenWatch, on the client current now (re-authentication replaces it)."""
        client = self._client
        try:
            if end is None:
                watch_id = client.add_watch_prefix_callback(start, deliver, start_revision=revision)
            else:
                watch_id = client.add_watch_callback(start, deliver, range_end=end,
                                                     start_revision=revision)
        except etcd_exc.RevisionCompactedError as exc:
            raise Compacted(exc.compacted_revision) from exc
        return lambda: client.cancel_watch(watch_id)

    def compact(self, revision: int) -> None:  # what etcd's auto-compaction does
        self._retrying(lambda: self._client.compact(revision), "a compaction")


class _Transient(Exception):
    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, grpc.RpcError):
        return exc.code() in _TRANSIENT_CODES
    return isinstance(exc, (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError,
                            etcd_exc.NoServerAvailableError))


def _token_expired(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAUTHENTICATED \
        and "token" in (exc.details() or "")


def _to_kv(kv) -> KeyValue:
    return KeyValue(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision,
                    kv.version, kv.lease)


_CMP_RESULTS = {"==": etcdrpc.Compare.EQUAL, "!=": etcdrpc.Compare.NOT_EQUAL,
                "<": etcdrpc.Compare.LESS, ">": etcdrpc.Compare.GREATER}


def _compare_message(compare: Compare):
    message = etcdrpc.Compare(key=compare.key.encode(), result=_CMP_RESULTS[compare.op])
    if compare.prefix:
        message.range_end = pyetcd.utils.prefix_range_end(compare.key.encode())
    if compare.target == "create":
        message.target = etcdrpc.Compare.CREATE
        message.create_revision = int(compare.operand)
    elif compare.target == "mod":
        message.target = etcdrpc.Compare.MOD
        message.mod_revision = int(compare.operand)
    elif compare.target == "version":
        message.target = etcdrpc.Compare.VERSION
        message.version = int(compare.operand)
    else:
        message.target = etcdrpc.Compare.VALUE
        message.value = bytes(compare.operand)
    return message


def _txn_message(compares, success, failure):
    return etcdrpc.TxnRequest(compare=[_compare_message(c) for c in compares],
                              success=[_op_message(op) for op in success],
                              failure=[_op_message(op) for op in failure])


def _op_message(op: Put | Delete | Get | Nested):
    if isinstance(op, Nested):
        return etcdrpc.RequestOp(request_txn=_txn_message(op.compares, op.success, op.failure))
    if isinstance(op, Put):
        request = etcdrpc.PutRequest(key=op.key.encode(), value=op.value, lease=op.lease or 0)
        return etcdrpc.RequestOp(request_put=request)
    if isinstance(op, Get):
        read = etcdrpc.RangeRequest(key=op.key.encode(), count_only=op.count_only)
        if op.end is not None:
            read.range_end = op.end.encode()
        elif op.prefix:
            read.range_end = pyetcd.utils.prefix_range_end(op.key.encode())
        return etcdrpc.RequestOp(request_range=read)
    request = etcdrpc.DeleteRangeRequest(key=op.key.encode())
    if op.prefix:
        request.range_end = pyetcd.utils.prefix_range_end(op.key.encode())
    return etcdrpc.RequestOp(request_delete_range=request)


def _read_delivery(response) -> list[WatchEvent] | None:
    """What pyetcd delivered to a watch callback (watch.py's ReadDelivery)."""
    if isinstance(response, etcd_exc.RevisionCompactedError):
        raise Compacted(response.compacted_revision)
    if isinstance(response, BaseException) or response is None:
        return None
    return [_to_event(e) for e in response.events]


def _open_keepalive_stream(client: pyetcd.MultiEndpointEtcd3Client, requests):
    """A LeaseKeepAlive call that lives as long as `requests` (no timeout: it is meant
    to stay open), with the client's credentials and auth token."""
    return client.leasestub.LeaseKeepAlive(requests, None, credentials=client.call_credentials,
                                           metadata=client.metadata)


def _keepalive_request(lease_id: int):
    return etcdrpc.LeaseKeepAliveRequest(ID=lease_id)


def _close_quietly(client) -> None:
    if client is None:
        return
    try:
        client.close()
    except Exception:  # closing a broken channel must not mask the real error
        log.debug("closing an etcd channel failed", exc_info=True)


def _to_event(event) -> WatchEvent:
    kind = "delete" if isinstance(event, pyetcd.events.DeleteEvent) else "put"
    return WatchEvent(kind, event.key.decode(), event.value, event.mod_revision,
                      event.create_revision, event.version, event.lease)
