"""Spot notices from a cloud metadata service (--notice-from): a fake metadata server on
127.0.0.1 serves each cloud's documented answers, refuses what the real one refuses,
and the watcher is asserted on outcomes (event set or not, log lines, clean stop)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from elastic_runner.agent.cloud_notice import (
    AwsNotice, AzureNotice, CloudNoticeWatcher, GcpNotice, MetadataError, _Http, make_checker,
)
from elastic_runner.config import CloudNoticeConfig

VM_NAME = "trainer-7"
WAIT_S = 20.0  # bound on waiting for an outcome; never asserted as a timing


class FakeMetadata:
    """The three clouds' metadata services in one loopback HTTP server.

    `mode`: "none" (no notice), "notice", "error" (HTTP 500), "slow" (answers after
    the client has given up), "other-vm" (Azure: Preempt for another VM), "freeze"
    (Azure: a non-Preempt event for this VM), "stop" (AWS: action stop).
    """

    def __init__(self):
        self.mode = "none"
        self.tokens: set[str] = set()
        self.token_puts = 0
        # (method, path with query, headers: an email.message.Message, case-insensitive)
        self.requests: list[tuple[str, str, object]] = []
        self.release = threading.Event()  # ends slow answers at teardown
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_PUT(self):
                fake.handle(self, "PUT")

            def do_GET(self):
                fake.handle(self, "GET")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    # ---- answering ------------------------------------------------------------
    @staticmethod
    def reply(handler, status: int, body: bytes | str, headers: dict[str, str] | None = None):
        data = body.encode() if isinstance(body, str) else body
        handler.send_response(status)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def handle(self, handler, method: str) -> None:
        path, _, query = handler.path.partition("?")
        self.requests.append((method, handler.path, handler.headers))
        if handler.headers.get("X-Forwarded-For"):  # all three refuse proxied requests
            return self.reply(handler, 403, "Forbidden")
        if self.mode == "slow":
            self.release.wait(10)
            try:
                return self.reply(handler, 500, "too late")
            except (BrokenPipeError, ConnectionResetError):
                return None  # the watcher gave up on this answer, as the test wants
        routes = {
            ("PUT", "/latest/api/token"): self.aws_token,
            ("GET", "/latest/meta-data/spot/instance-action"): self.aws_action,
            ("GET", "/computeMetadata/v1/instance/preempted"): self.gcp_preempted,
            ("GET", "/metadata/scheduledevents"): self.azure_events,
            ("GET", "/metadata/instance/compute/name"): self.azure_name,
        }
        route = routes.get((method, path))
        if route is None:
            return self.reply(handler, 404, "Not Found")
        route(handler, urllib.parse.parse_qs(query))

    def aws_token(self, handler, _query):
        ttl = handler.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
        if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            return self.reply(handler, 400, "Bad Request")
        if self.mode == "error":
            return self.reply(handler, 500, "Internal Server Error")
        self.token_puts += 1
        token = f"token-{self.token_puts}"
        self.tokens.add(token)
        self.reply(handler, 200, token, {"X-aws-ec2-metadata-token-ttl-seconds": ttl})

    def aws_action(self, handler, _query):
        if handler.headers.get("X-aws-ec2-metadata-token") not in self.tokens:
            return self.reply(handler, 401, "Unauthorized")  # IMDSv2 required
        if self.mode == "error":
            return self.reply(handler, 500, "Internal Server Error")
        if self.mode in ("notice", "stop"):
            action = "terminate" if self.mode == "notice" else "stop"
            return self.reply(handler, 200, json.dumps(
                {"action": action, "time": "2017-09-18T08:22:00Z"}),
                {"Content-Type": "text/plain"})
        self.reply(handler, 404, "Not Found")

    def gcp_preempted(self, handler, _query):
        if handler.headers.get("Metadata-Flavor") != "Google":
            return self.reply(handler, 403, "Missing Metadata-Flavor:Google header.")
        if self.mode == "error":
            return self.reply(handler, 503, "Service Unavailable")
        self.reply(handler, 200, "TRUE" if self.mode == "notice" else "FALSE",
                   {"Metadata-Flavor": "Google", "Content-Type": "application/text"})

    def azure_refuses(self, handler, query) -> bool:
        if handler.headers.get("Metadata") != "true":
            self.reply(handler, 400, json.dumps(
                {"error": "Bad request. Required metadata header not specified"}))
            return True
        if "api-version" not in query:
            self.reply(handler, 400, json.dumps({"error": "Bad request. api-version was not "
                                                          "specified in the request."}))
            return True
        return False

    def azure_name(self, handler, query):
        if not self.azure_refuses(handler, query):
            self.reply(handler, 200, VM_NAME, {"Content-Type": "text/plain"})

    def azure_events(self, handler, query):
        if self.azure_refuses(handler, query):
            return
        if self.mode == "error":
            return self.reply(handler, 500, json.dumps({"error": "Internal Server Error"}))
        events = []
        if self.mode in ("notice", "other-vm", "freeze"):
            events.append({
                "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
                "EventType": "Freeze" if self.mode == "freeze" else "Preempt",
                "ResourceType": "VirtualMachine",
                "Resources": ["other-vm" if self.mode == "other-vm" else VM_NAME.upper()],
                "EventStatus": "Scheduled",
                "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT",
                "Description": "",
                "EventSource": "Platform",
                "DurationInSeconds": -1,
            })
        self.reply(handler, 200, json.dumps({"DocumentIncarnation": 1, "Events": events}),
                   {"Content-Type": "application/json"})


@pytest.fixture
def fake():
    with FakeMetadata() as server:
        yield server


@pytest.fixture
def lines():
    """Log records of the watcher's logger, whatever the CLI did to logging before."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("elastic_runner.agent.cloud_notice")
    handler = Collect(logging.DEBUG)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def warnings_in(records):
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def config(cloud: str, url: str, timeout_s: float = 2.0) -> CloudNoticeConfig:
    return CloudNoticeConfig(cloud, url, interval_s=0.02, timeout_s=timeout_s)


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---- the fake refuses what the real services refuse --------------------------------
def test_fake_refuses_requests_without_the_cloud_headers(fake):
    http = _Http(fake.url, 2.0)
    assert http("GET", AwsNotice.ACTION_PATH, {})[0] == 401
    assert http("PUT", AwsNotice.TOKEN_PATH, {})[0] == 400
    assert http("GET", GcpNotice.PATH, {})[0] == 403
    assert http("GET", AzureNotice.EVENTS_PATH, {})[0] == 400
    assert http("GET", "/metadata/scheduledevents", {"Metadata": "true"})[0] == 400


# ---- AWS ------------------------------------------------------------------------------
def test_aws_no_notice_is_404(fake):
    checker = make_checker(config("aws", fake.url))
    assert checker.check() is False
    assert checker.check() is False
    assert fake.token_puts == 1  # the token is reused, not fetched per poll
    method, path, headers = fake.requests[-1]
    assert (method, path) == ("GET", AwsNotice.ACTION_PATH)
    assert headers["X-aws-ec2-metadata-token"] == "token-1"


@pytest.mark.parametrize("mode, action", [("notice", "terminate"), ("stop", "stop")])
def test_aws_instance_action_is_a_notice(fake, mode, action):
    fake.mode = mode
    checker = make_checker(config("aws", fake.url))
    assert checker.check() is True
    assert checker.detail == f"{action} at 2017-09-18T08:22:00Z"


def test_aws_expired_token_is_replaced(fake):
    checker = make_checker(config("aws", fake.url))
    assert checker.check() is False
    fake.tokens.clear()  # the token expired: the service answers 401 to it
    fake.mode = "notice"
    assert checker.check() is True
    assert fake.token_puts == 2
    statuses = [(m, p) for m, p, _ in fake.requests]
    assert statuses[-3:] == [("GET", AwsNotice.ACTION_PATH), ("PUT", AwsNotice.TOKEN_PATH),
                             ("GET", AwsNotice.ACTION_PATH)]


def test_aws_token_renewed_before_its_ttl(fake):
    now = [0.0]
    checker = AwsNotice(_Http(fake.url, 2.0), clock=lambda: now[0])
    checker.check()
    now[0] = AwsNotice.TOKEN_TTL_S - AwsNotice.TOKEN_MARGIN_S + 1
    checker.check()
    assert fake.token_puts == 2


def test_aws_server_error_raises(fake):
    fake.mode = "error"
    with pytest.raises(MetadataError, match="HTTP 500"):
        make_checker(config("aws", fake.url)).check()


# ---- GCP ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, expected", [("none", False), ("notice", True)])
def test_gcp_preempted(fake, mode, expected):
    fake.mode = mode
    assert make_checker(config("gcp", fake.url)).check() is expected
    _, path, headers = fake.requests[-1]
    assert path == GcpNotice.PATH and headers["Metadata-Flavor"] == "Google"


def test_gcp_server_error_raises(fake):
    fake.mode = "error"
    with pytest.raises(MetadataError, match="HTTP 503"):
        make_checker(config("gcp", fake.url)).check()


# ---- Azure ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode, expected", [
    ("none", False),
    ("notice", True),      # Preempt naming this VM (in another letter case)
    ("other-vm", False),   # Preempt for another VM of the availability set
    ("freeze", False),     # a scheduled event that is not an eviction
])
def test_azure_preempt_event_for_this_vm(fake, mode, expected):
    fake.mode = mode
    checker = make_checker(config("azure", fake.url))
    assert checker.check() is expected
    assert checker.vm_name == VM_NAME
    assert all(headers["Metadata"] == "true" for _, _, headers in fake.requests)
    assert fake.requests[-1][1] == AzureNotice.EVENTS_PATH


def test_azure_server_error_raises(fake):
    fake.mode = "error"
    with pytest.raises(MetadataError, match="HTTP 500"):
        make_checker(config("azure", fake.url)).check()


# ---- the watcher thread ---------------------------------------------------------------
@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_watcher_sets_event_on_notice_and_ends(fake, lines, cloud):
    woken = threading.Event()
    watcher = CloudNoticeWatcher(config(cloud, fake.url), on_notice=woken.set)
    watcher.start()
    try:
        wait_for(lambda: watcher.polls >= 3, "polls with no notice")
        assert not watcher.notice.is_set()
        fake.mode = "notice"
        assert watcher.notice.wait(WAIT_S)
        assert woken.is_set()
        assert watcher.source == cloud
        wait_for(lambda: not watcher.is_alive(), "the watcher to end after a notice")
    finally:
        watcher.stop()
    assert warnings_in(lines) == []
    assert any("spot notice" in r.getMessage() for r in lines)


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_server_errors_warn_once_then_recover(fake, lines, cloud):
    fake.mode = "error"
    watcher = CloudNoticeWatcher(config(cloud, fake.url)).start()
    try:
        wait_for(lambda: watcher.polls >= 8, "many failing polls")
        assert len(warnings_in(lines)) == 1
        assert not watcher.notice.is_set()
        fake.mode = "none"
        wait_for(lambda: any("answers again" in r.getMessage() for r in lines), "recovery")
        fake.mode = "notice"
        assert watcher.notice.wait(WAIT_S)
    finally:
        watcher.stop()
    assert len(warnings_in(lines)) == 1
    recovered = [r for r in lines if "answers again" in r.getMessage()]
    assert [r.levelno for r in recovered] == [logging.INFO]


def test_unreachable_service_is_one_warning_line(lines):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    watcher = CloudNoticeWatcher(config("aws", url)).start()
    try:
        wait_for(lambda: watcher.polls >= 10, "many refused polls")
    finally:
        watcher.stop()
    assert not watcher.is_alive()
    assert not watcher.notice.is_set()
    (warning,) = warnings_in(lines)
    assert "AWS metadata service" in warning and url in warning
    assert "connection refused" in warning
    assert "\n" not in warning


def test_slow_answer_past_the_timeout_is_a_failure_not_a_hang(fake, lines):
    fake.mode = "slow"
    watcher = CloudNoticeWatcher(config("gcp", fake.url, timeout_s=0.2)).start()
    try:
        wait_for(lambda: watcher.polls >= 3, "polls that time out")
    finally:
        watcher.stop()
    assert not watcher.is_alive()
    assert not watcher.notice.is_set()
    (warning,) = warnings_in(lines)
    assert "timeout" in warning


def test_flapping_service_warns_once_and_reports_later_recoveries_at_debug(fake, lines):
    watcher = CloudNoticeWatcher(config("gcp", fake.url))
    for mode in ["error", "none"] * 4:
        fake.mode = mode
        watcher.poll_once()
    assert len(warnings_in(lines)) == 1
    levels = [r.levelno for r in lines if "answers again" in r.getMessage()]
    assert levels == [logging.INFO] + [logging.DEBUG] * 3


def test_proxy_environment_is_ignored(fake, monkeypatch):
    dead_proxy = f"http://127.0.0.1:{free_port()}"
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                 "ALL_PROXY"):
        monkeypatch.setenv(name, dead_proxy)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    fake.mode = "notice"
    assert make_checker(config("gcp", fake.url)).check() is True
    assert not any("X-Forwarded-For" in headers for _, _, headers in fake.requests)


def test_stop_is_safe_without_start_and_twice(fake):
    CloudNoticeWatcher(config("azure", fake.url)).stop()
    watcher = CloudNoticeWatcher(config("azure", fake.url)).start()
    wait_for(lambda: watcher.polls >= 1, "one poll")
    watcher.stop()
    watcher.stop()
    assert not watcher.is_alive()
    assert not watcher.notice.is_set()
