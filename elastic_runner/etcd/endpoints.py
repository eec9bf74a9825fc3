"""Parsing etcd endpoint URLs, apart from the client so that verbs which never talk to
etcd (`deploy`, `report`) and the CLI's flag checks need not import grpc."""

from __future__ import annotations

from urllib.parse import urlparse

from elastic_runner.errors import ConfigError


def parse_endpoint(url: str) -> tuple[str, int, bool]:
    """Split `http://host:2379` into (host, port, tls); bare host:port allowed."""
    text = url.strip()
    parsed = urlparse(text if "://" in text else f"http://{text}")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(
            f"malformed etcd endpoint {url!r}: use http://HOST:PORT or https://HOST:PORT"
        )
    try:
        port = parsed.port or 2379
    except ValueError as exc:
        raise ConfigError(f"malformed etcd endpoint {url!r}: bad port ({exc})") from exc
    return parsed.hostname, port, parsed.scheme == "https"
