"""The launcher and the torchrun plug-in refuse the same numbers with the same rule
(validation.NUMBER_BOUNDS), and say so in the same words, each naming its own key."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastic_runner.cli.flags import parse_args
from elastic_runner.cli.run import build_config
from elastic_runner.errors import ConfigError
from elastic_runner.rendezvous.torchrun_plugin import (
    RdzvConfError, etcd_config, rendezvous_config,
)

# (launcher flag, --rdzv-conf key, value): each row is out of range for both.
REFUSED = [
    ("--lease-ttl", "lease_ttl", "0"),
    ("--lease-ttl", "lease_ttl", "-3"),
    ("--settle", "settle", "-5"),
    ("--settle-max", "settle_max", "-1"),
    ("--suspect-grace", "suspect_grace", "-0.5"),
    ("--join-timeout", "join_timeout", "0"),
    ("--join-timeout", "join_timeout", "nan"),
    ("--master-port", "master_port", "0"),
    ("--master-port", "master_port", "70000"),
    ("--nproc-per-node", "nproc", "0"),
    ("--etcd-timeout", "etcd_timeout", "0"),
    ("--etcd-timeout", "etcd_timeout", "-2.5"),
]
# In range for both: the edges of the same bounds.
ACCEPTED = [
    ("--lease-ttl", "lease_ttl", "1"),
    ("--settle", "settle", "0"),
    ("--suspect-grace", "suspect_grace", "0"),
    ("--master-port", "master_port", "65535"),
    ("--nproc-per-node", "nproc", "1"),
    ("--etcd-timeout", "etcd_timeout", "0.5"),
    ("--join-timeout", "join_timeout", "0.5"),
]


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print(1)\n")
    return str(path)


def launcher(script: str, *flags: str):
    return build_config(parse_args([*flags, script], {}), {}, 0)


def plugin(**conf: str):
    """Both halves of the plug-in's configuration: the rendezvous, then etcd."""
    params = RendezvousParameters("etcd-v3", "127.0.0.1:2379", "job", 1, 2, **conf)
    rdzv = rendezvous_config(params)
    return rdzv, etcd_config(params, rdzv.lease_ttl_s)


@pytest.mark.parametrize("flag, key, value", REFUSED)
def test_both_refuse_with_the_same_line(script, flag, key, value):
    with pytest.raises(ConfigError) as by_launcher:
        launcher(script, f"{flag}={value}")
    with pytest.raises(RdzvConfError) as by_plugin:
        plugin(**{key: value})
    expected = str(by_launcher.value).replace(flag, f"--rdzv-conf {key}", 1)
    assert str(by_plugin.value) == expected
    assert "need " in expected and "\n" not in expected


@pytest.mark.parametrize("flag, key, value", ACCEPTED)
def test_both_accept_the_edges(script, flag, key, value):
    launcher(script, f"{flag}={value}")
    plugin(**{key: value})


def test_settle_cap_below_the_quiet_is_refused_by_both(script):
    with pytest.raises(ConfigError) as by_launcher:
        launcher(script, "--settle", "3", "--settle-max", "1")
    with pytest.raises(RdzvConfError) as by_plugin:
        plugin(settle="3", settle_max="1")
    assert str(by_plugin.value) == str(by_launcher.value).replace(
        "--settle-max", "--rdzv-conf settle_max").replace("--settle ", "--rdzv-conf settle ")


def test_a_long_settle_raises_the_default_cap_in_both(script):
    rdzv, _ = plugin(settle="40")
    assert rdzv.settle_max_s == launcher(script, "--settle", "40").rendezvous.settle_max_s == 40


@pytest.mark.parametrize("key", ["lease_ttl", "master_port", "nproc"])
def test_whole_number_settings_refuse_fractions_in_both(script, key):
    flag = {"lease_ttl": "--lease-ttl", "master_port": "--master-port",
            "nproc": "--nproc-per-node"}[key]
    with pytest.raises((ConfigError, SystemExit)):
        launcher(script, flag, "2.5")
    with pytest.raises(RdzvConfError, match=f"--rdzv-conf {key}='2.5' is not a whole number"):
        plugin(**{key: "2.5"})


def test_the_plugin_error_is_what_torch_and_the_cli_expect():
    with pytest.raises(ValueError) as caught:
        plugin(lease_ttl="0")
    assert isinstance(caught.value, ConfigError) and caught.value.exit_code == 2


def test_the_timeout_torchrun_sets_is_checked_under_its_own_key():
    with pytest.raises(RdzvConfError, match="--rdzv-conf timeout 0: need a positive"):
        plugin(timeout="0")
    rdzv, _ = plugin(timeout="0", join_timeout="20")
    assert rdzv.join_timeout_s == 20
