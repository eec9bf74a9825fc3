"""Spot notices from the cloud's own metadata service (--notice-from aws|gcp|azure).

A thread in the agent polls the instance metadata service the way each cloud
documents it and sets `CloudNoticeWatcher.notice` (a threading.Event) once the
service says this node is about to be reclaimed. The agent treats that like any
other spot notice. Torch-free, grpc-free, standard library only; every knob comes
from CloudNoticeConfig (no environment reads here).

The protocols, as implemented (base URL = --notice-url, else the cloud's default):

AWS (IMDSv2), default http://169.254.169.254
    PUT  /latest/api/token  with X-aws-ec2-metadata-token-ttl-seconds: 21600
         -> 200, the token as text. Kept and reused until a minute before its TTL.
    GET  /latest/meta-data/spot/instance-action  with X-aws-ec2-metadata-token: TOKEN
         404 -> no notice; 200 -> notice (JSON {"action": "terminate"|"stop"|"hibernate",
         "time": "...Z"}; the action is logged, any 200 counts, as AWS documents the
         item exists only when an interruption is scheduled); 401 -> the token
         expired or was revoked: fetch a new one and ask again, once per poll.
    IMDSv1 (no token) is never used: instances that require IMDSv2 refuse it. In a
    container, the instance's metadata hop limit must be at least 2 or the token
    request never comes back (the warning line says so).

GCP, default http://metadata.google.internal
    GET  /computeMetadata/v1/instance/preempted  with Metadata-Flavor: Google
         200 "TRUE" -> notice; 200 "FALSE" -> no notice; anything else is an error.
    Plain polling, not `?wait_for_change=true`: a hanging request cannot have the
    short per-request timeout that tells a dead metadata server from a quiet one,
    stop() would have to wait out the hang, and one code path serves all three
    clouds. A poll every 1-2 s costs at most that much of GCP's 30 s notice.

Azure (Scheduled Events), default http://169.254.169.254
    GET  /metadata/scheduledevents?api-version=2020-07-01  with Metadata: true
         200 JSON {"DocumentIncarnation": n, "Events": [...]}; an event with
         "EventType": "Preempt" is a notice when it concerns this VM.
    Azure delivers one availability set's or scale-set placement group's events to
    all of its VMs and names the affected VMs in the event's "Resources". This VM's
    name comes from GET /metadata/instance/compute/name?api-version=2021-02-01&
    format=text (same header), asked once and kept; it is compared case-insensitively
    (Azure names are). An event with an empty Resources list counts for every VM.
    Events are not acknowledged (no POST StartRequests): that would bring the
    eviction forward, and the notice is meant to buy time. The first request on a
    VM enables Scheduled Events and may take up to two minutes to answer; until
    then polls time out, which is reported as below and then recovers.

Failures (unreachable, timeout, HTTP 5xx, a refused or garbled answer) never end
the watcher and never fail the run: the first one is ONE warning line, further
ones are debug lines, the first recovery is an info line, and later outages and
recoveries are debug lines (a flapping service must not flood the log). Requests
bypass any proxy named in the environment (an empty ProxyHandler; metadata
services refuse proxied requests and a proxy cannot reach them) and do not follow
redirects (no metadata service redirects; the headers must not go elsewhere).
Once a notice is seen the watcher logs it, sets the event, calls `on_notice`, and
stops polling: a reclaim is not withdrawn.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from http.client import HTTPException
from typing import Callable

from elastic_runner.config import CloudNoticeConfig

log = logging.getLogger(__name__)

CLOUDS = ("aws", "gcp", "azure")
DEFAULT_BASE_URLS = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
CLOUD_NAMES = {"aws": "AWS", "gcp": "GCP", "azure": "Azure"}
# What the warning line adds for a cloud whose service is known to go quiet.
HINTS = {
    "aws": "; in a container the instance's metadata hop limit must be 2 or more",
    "gcp": "",
    "azure": "; Azure's first Scheduled Events request can take up to 2 minutes",
}
# Metadata answers are tiny; never read more than this from one.
MAX_BODY = 64 * 1024


class MetadataError(Exception):
    """The metadata service gave no usable answer: unreachable, timed out, 5xx, refused
    the request, or answered something the protocol does not allow."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # urllib then raises HTTPError with the 3xx status


def metadata_opener() -> urllib.request.OpenerDirector:
    """An opener that ignores proxy variables (HTTP_PROXY, ...) and redirects."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def _describe(exc: BaseException) -> str:
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, TimeoutError):
        return "no answer within the timeout"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    text = getattr(reason, "strerror", None) or str(reason) or type(reason).__name__
    return text


class _Http:
    """One request, one answer: (status, body) for every HTTP status, MetadataError for
    everything that is not an HTTP answer (refused, timed out, reset, bad URL)."""

    def __init__(self, base_url: str, timeout_s: float,
                 opener: urllib.request.OpenerDirector | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.opener = opener or metadata_opener()

    def __call__(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        request = urllib.request.Request(self.base_url + path, method=method, headers=headers)
        try:
            with self.opener.open(request, timeout=self.timeout_s) as response:
                return response.status, response.read(MAX_BODY)
        except urllib.error.HTTPError as exc:
            try:
                body = exc.read(MAX_BODY)
            except (OSError, HTTPException):
                body = b""
            finally:
                exc.close()
            return exc.code, body
        except (OSError, HTTPException, ValueError) as exc:
            raise MetadataError(f"{method} {path}: {_describe(exc)}") from exc


def _unexpected(method: str, path: str, status: int, body: bytes) -> MetadataError:
    text = body.decode("utf-8", "replace").strip().splitlines()
    return MetadataError(f"{method} {path}: HTTP {status}" + (f" {text[0][:120]}" if text else ""))


class AwsNotice:
    """EC2 spot interruption notice over IMDSv2."""

    TOKEN_PATH = "/latest/api/token"
    ACTION_PATH = "/latest/meta-data/spot/instance-action"
    TOKEN_TTL_S = 21600  # the most IMDSv2 grants
    TOKEN_MARGIN_S = 60.0

    def __init__(self, http: _Http, clock: Callable[[], float] = time.monotonic):
        self._http = http
        self._clock = clock
        self._token: str | None = None
        self._token_expires = 0.0
        self.detail = ""

    def _fresh_token(self) -> str:
        if self._token is not None and self._clock() < self._token_expires:
            return self._token
        status, body = self._http("PUT", self.TOKEN_PATH,
                                  {"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL_S)})
        token = body.decode("ascii", "replace").strip()
        if status != 200 or not token:
            raise _unexpected("PUT", self.TOKEN_PATH, status, body)
        self._token = token
        self._token_expires = self._clock() + self.TOKEN_TTL_S - self.TOKEN_MARGIN_S
        return token

    def _action(self, token: str) -> tuple[int, bytes]:
        return self._http("GET", self.ACTION_PATH, {"X-aws-ec2-metadata-token": token})

    def check(self) -> bool:
        status, body = self._action(self._fresh_token())
        if status == 401:  # the token expired or was revoked: one new token, one retry
            self._token = None
            status, body = self._action(self._fresh_token())
        if status == 404:
            return False
        if status == 200:
            try:
                action = json.loads(body)
                self.detail = f"{action['action']} at {action['time']}"
            except (ValueError, TypeError, KeyError):
                self.detail = "spot/instance-action is present"
            return True
        raise _unexpected("GET", self.ACTION_PATH, status, body)


class GcpNotice:
    """Compute Engine preemption (spot and preemptible VMs)."""

    PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(self, http: _Http):
        self._http = http
        self.detail = ""

    def check(self) -> bool:
        status, body = self._http("GET", self.PATH, {"Metadata-Flavor": "Google"})
        value = body.decode("ascii", "replace").strip().upper()
        if status == 200 and value in ("TRUE", "FALSE"):
            self.detail = "instance/preempted is TRUE" if value == "TRUE" else ""
            return value == "TRUE"
        raise _unexpected("GET", self.PATH, status, body)


class AzureNotice:
    """Azure Scheduled Events: a Preempt event (Spot VM eviction) naming this VM."""

    EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
    NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
    HEADERS = {"Metadata": "true"}

    def __init__(self, http: _Http):
        self._http = http
        self.vm_name: str | None = None
        self.detail = ""

    def _name(self) -> str:
        if self.vm_name is None:
            status, body = self._http("GET", self.NAME_PATH, self.HEADERS)
            name = body.decode("utf-8", "replace").strip()
            if status != 200 or not name:
                raise _unexpected("GET", self.NAME_PATH, status, body)
            self.vm_name = name
        return self.vm_name

    def check(self) -> bool:
        name = self._name()
        status, body = self._http("GET", self.EVENTS_PATH, self.HEADERS)
        if status != 200:
            raise _unexpected("GET", self.EVENTS_PATH, status, body)
        try:
            events = json.loads(body).get("Events") or []
            for event in events:
                if event.get("EventType") != "Preempt":
                    continue
                resources = [str(r).lower() for r in event.get("Resources") or []]
                if not resources or name.lower() in resources:
                    self.detail = (f"Preempt event {event.get('EventId', '?')} not before "
                                   f"{event.get('NotBefore') or 'now'}")
                    return True
        except (ValueError, AttributeError, TypeError) as exc:
            raise MetadataError(f"GET {self.EVENTS_PATH}: not a Scheduled Events document "
                                f"({exc})") from exc
        return False


CHECKERS = {"aws": AwsNotice, "gcp": GcpNotice, "azure": AzureNotice}


def make_checker(config: CloudNoticeConfig,
                 opener: urllib.request.OpenerDirector | None = None):
    """The cloud's checker: .check() -> True (notice) / False (none) / raises MetadataError."""
    if config.cloud not in CHECKERS:
        raise ValueError(f"unknown cloud {config.cloud!r}; one of {', '.join(CLOUDS)}")
    return CHECKERS[config.cloud](_Http(config.base_url, config.timeout_s, opener))


class CloudNoticeWatcher:
    """Polls the metadata service in a daemon thread; `notice` is set on a spot notice.

        watcher = CloudNoticeWatcher(config.cloud_notice, on_notice=wake)
        watcher.start()
        ... watcher.notice.is_set() ...
        watcher.stop()
    """

    def __init__(self, config: CloudNoticeConfig, *,
                 on_notice: Callable[[], None] | None = None,
                 opener: urllib.request.OpenerDirector | None = None):
        self.config = config
        self.notice = threading.Event()
        self.detail = ""
        self.polls = 0  # finished polls, successful or not (for tests and debugging)
        self._checker = make_checker(config, opener)
        self._on_notice = on_notice
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"elastic-run-{config.cloud}-notice")
        self._failing = False
        self._warned = False
        self._recovered = False

    @property
    def source(self) -> str:
        """The cloud's name as the agent reports the notice's source: aws, gcp or azure."""
        return self.config.cloud

    def start(self) -> CloudNoticeWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling; returns once the thread has ended (a request in flight ends
        within its timeout). Safe to call twice, or without start()."""
        self._stop.set()
        if self._thread.is_alive():
            # A poll makes at most four requests (AWS: token, ask, new token, ask).
            self._thread.join(4 * self.config.timeout_s + self.config.interval_s + 1.0)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def poll_once(self) -> bool:
        """Ask the service once; True when it gave a notice. Never raises."""
        try:
            seen = self._checker.check()
        except Exception as exc:  # noqa: BLE001 - a watcher must never crash the agent
            self._failed(exc)
            return False
        finally:
            self.polls += 1
        self._answered()
        if seen:
            self.detail = self._checker.detail
            log.info("spot notice from the %s metadata service: %s",
                     CLOUD_NAMES[self.config.cloud], self.detail)
            self.notice.set()
            if self._on_notice is not None:
                try:
                    self._on_notice()
                except Exception:  # noqa: BLE001 - the event is set; the callback only hurries
                    log.debug("on_notice callback failed", exc_info=True)
        return seen

    def _failed(self, exc: Exception) -> None:
        if self._failing:
            log.debug("%s metadata service still not answering: %s",
                      CLOUD_NAMES[self.config.cloud], exc)
            return
        self._failing = True
        if not self._warned:
            self._warned = True
            log.warning("no usable answer from the %s metadata service at %s (%s); its spot "
                        "notices go unseen until it answers (SIGTERM and --notice-file still "
                        "work)%s", CLOUD_NAMES[self.config.cloud], self.config.base_url, exc,
                        HINTS[self.config.cloud])
        else:
            log.debug("%s metadata service not answering again: %s",
                      CLOUD_NAMES[self.config.cloud], exc)

    def _answered(self) -> None:
        if not self._failing:
            return
        self._failing = False
        level = logging.DEBUG if self._recovered else logging.INFO
        self._recovered = True
        log.log(level, "the %s metadata service answers again; watching for spot notices",
                CLOUD_NAMES[self.config.cloud])

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.poll_once():
                return
            self._stop.wait(self.config.interval_s)
