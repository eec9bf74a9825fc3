"""Timings derived once, in config.py: every etcd client and every caller of a
lease-derived timing gets it from the same rule (no etcd, no processes)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from elastic_runner import config as c
from elastic_runner.cli import status
from elastic_runner.cli.flags import apply_env_defaults, parse_args
from elastic_runner.cli.run import build_config

PACKAGE = Path(c.__file__).resolve().parent


@pytest.mark.parametrize("ttl, grace, deadline, keepalive", [
    (1, 2.0, 5.0, 1 / 3), (2, 4.0, 5.0, 2 / 3), (5, 10.0, 10.0, 5 / 3), (30, 60.0, 60.0, 10.0),
])
def test_lease_holder_timings(ttl, grace, deadline, keepalive):
    rdzv = c.RendezvousConfig("run", "node", lease_ttl_s=ttl)
    assert rdzv.etcd_grace_s == grace
    assert rdzv.keepalive_interval_s == pytest.approx(keepalive)
    assert rdzv.write_visible_timeout_s == ttl
    etcd = c.EtcdConfig.build(("http://h:1",), 5.0, lease_ttl_s=ttl)
    assert etcd.retry_deadline_s == deadline == max(rdzv.etcd_grace_s, c.MIN_RETRY_DEADLINE_S)


def test_keepalive_has_a_floor():
    assert c.keepalive_interval_s(0.3) == c.MIN_KEEPALIVE_INTERVAL_S


@pytest.mark.parametrize("timeout, deadline", [(1.0, 5.0), (5.0, 10.0), (30.0, 60.0)])
def test_client_without_a_lease_retries_two_call_timeouts(timeout, deadline):
    assert c.EtcdConfig.build(("http://h:1",), timeout).retry_deadline_s == deadline


def test_build_keeps_access_fields_and_drops_empty_ones():
    etcd = c.EtcdConfig.build(["http://h:1"], 2.0, cacert="", cert="c", key="k", user="u",
                              password="pw", binary="etcd")
    assert (etcd.endpoints, etcd.cacert, etcd.cert, etcd.key, etcd.user, etcd.binary) == \
        (("http://h:1",), None, "c", "k", "u", "etcd")
    assert "pw" not in repr(etcd)
    moved = dataclasses.replace(etcd, endpoints=("http://other:2",))
    assert moved.password == "pw" and moved.retry_deadline_s == etcd.retry_deadline_s


def test_the_launcher_uses_the_lease_rule(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    config = build_config(parse_args(["--lease-ttl", "7", "--etcd-timeout", "2", str(script)],
                                      {}), {}, 0)
    assert config.etcd.retry_deadline_s == c.retry_deadline_s(2.0, 7) == 14.0


def test_status_uses_the_no_lease_rule():
    args = status.build_parser().parse_args(["--rdzv-endpoints", "http://h:1",
                                             "--etcd-timeout", "4"])
    assert status.etcd_config(args, {}).retry_deadline_s == c.retry_deadline_s(4.0) == 8.0


def test_status_reads_its_flags_from_the_environment():
    parser = status.build_parser()
    apply_env_defaults(parser, {"ELASTIC_RUN_EVENTS": "3", "ELASTIC_RUN_JSON": "yes"},
                       status.STATUS_FLAGS)
    args = parser.parse_args([])
    assert (args.events, args.json) == (3, True)
    assert isinstance(args, argparse.Namespace)


def test_etcd_config_is_built_only_by_the_factory():
    """Outside config.py, production code builds EtcdConfig through EtcdConfig.build."""
    direct = re.compile(r"\bEtcdConfig\(")
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if p.name != "config.py" and direct.search(p.read_text())]
    assert offenders == []


@pytest.mark.parametrize("module", ["main", "flags", "run", "status", "notice"])
def test_the_cli_uses_no_argparse_internals(module):
    text = (PACKAGE / "cli" / f"{module}.py").read_text()
    assert not re.search(r"argparse\._|\._actions\b|_option_string_actions|\._defaults\b", text)
