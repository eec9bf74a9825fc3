"""Flag checks that turn bad values into one line (validation.py), without processes."""

from __future__ import annotations

import pytest

from elastic_runner.cli.flags import parse_args
from elastic_runner.cli.run import build_config
from elastic_runner.errors import ConfigError
from elastic_runner.ids import id_problem
from elastic_runner.validation import (
    check_log_dir, check_master_addr, check_nproc, parse_bool, sanitize_id, worker_capacity,
)


@pytest.mark.parametrize("value", ["job7", "a", "node-1.2_3", "A" * 128, "10.0.0.1"])
def test_valid_ids(value):
    assert id_problem(value) is None


@pytest.mark.parametrize("value", ["", "a/b", "victim/rounds/0/join", "v3/nodes", "..", "a..b",
                                   "../../x", ".hidden", "-dash", "a\nb", "a b", "a'b", "$(id)",
                                   "A" * 129, "naïve", "x/"])
def test_invalid_ids(value):
    assert "is not a valid id" in id_problem(value)


@pytest.mark.parametrize("text, expected", [
    ("train", "train"), ("my train", "my-train"), ("..x", "x"), ("", "run"), ("..", "run"),
    ("héllo", "h-llo"), ("a/b", "a-b"), (".hidden", "hidden")])
def test_sanitize_id_gives_a_valid_id(text, expected):
    result = sanitize_id(text)
    assert id_problem(result) is None
    assert result == expected


@pytest.mark.parametrize("raw, value", [("1", True), ("TRUE", True), ("on", True), ("yes", True),
                                        ("0", False), ("false", False), ("", False), ("Off", False)])
def test_parse_bool(raw, value):
    assert parse_bool(raw, "ELASTIC_RUN_X") is value


def test_parse_bool_refuses_other_words():
    with pytest.raises(ConfigError, match="ELASTIC_RUN_STANDALONE='maybe' is not a boolean"):
        parse_bool("maybe", "ELASTIC_RUN_STANDALONE")


def test_worker_capacity_names_the_binding_limit():
    limit, why = worker_capacity(cpu_count=2)
    assert limit >= 64 or "ulimit" in why
    with pytest.raises(ConfigError, match="--nproc-per-node 10000: this node can hold at most 64"):
        check_nproc(10000, (64, "at most 16 per core"))
    assert check_nproc(8, (64, "cap")) == 8


def test_log_dir_below_a_file_and_a_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        check_log_dir(str(blocker))
    with pytest.raises(ConfigError, match="cannot create it"):
        check_log_dir(str(blocker / "below"))
    assert check_log_dir(str(tmp_path / "new" / "logs")).is_dir()


def config_for(tmp_path, *flags, environ=None):
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    environ = environ or {}
    return build_config(parse_args([*flags, str(script)], environ), environ, 0)


@pytest.mark.parametrize("flags, phrase", [
    (["--settle", "-5"], "--settle -5: need 0 or more seconds"),
    (["--settle", "3", "--settle-max", "1"], "--settle-max 1 is below --settle 3"),
    (["--max-restarts", "-1"], "--max-restarts -1"),
    (["--min-workers", "-4"], "--min-workers -4"),
    (["--monitor-interval", "0"], "--monitor-interval 0"),
    (["--etcd-timeout", "0"], "--etcd-timeout 0"),
    (["--join-timeout", "nan"], "--join-timeout nan"),
    (["--metrics-port", "65536"], "--metrics-port 65536"),
    (["--master-port", "0"], "--master-port 0"),
    (["--worker-timeout", "-1"], "--worker-timeout -1"),
    (["--run-id", "victim/rounds/0/join"], "--run-id 'victim/rounds/0/join' is not a valid id"),
    (["--node-id", "a/b"], "--node-id 'a/b' is not a valid id"),
    (["--run-id", "../../x"], "--run-id '../../x' is not a valid id"),
])
def test_bad_numbers_and_ids_are_one_config_error(tmp_path, flags, phrase):
    with pytest.raises(ConfigError) as caught:
        config_for(tmp_path, *flags)
    assert phrase in str(caught.value) and "\n" not in str(caught.value)


def test_settle_alone_raises_the_default_cap(tmp_path):
    config = config_for(tmp_path, "--settle", "40")
    assert config.rendezvous.settle_s == 40 and config.rendezvous.settle_max_s == 40


def test_default_run_id_of_an_odd_script_name_is_valid(tmp_path):
    script = tmp_path / "my train (v2).py"
    script.write_text("print(1)\n")
    config = build_config(parse_args([str(script)], {}), {}, 0)
    assert id_problem(config.rendezvous.run_id) is None
    assert config.rendezvous.run_id.startswith("my-train--v2-")


def test_abbreviated_flags_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        parse_args(["--max-node", "2", str(tmp_path / "t.py")], {})
    assert caught.value.code == 2
    assert "--max-node" in capsys.readouterr().err


def test_metrics_addr_defaults_to_all_interfaces_and_can_be_local(tmp_path):
    assert config_for(tmp_path, "--metrics-port", "0").metrics_addr == "0.0.0.0"
    local = config_for(tmp_path, "--metrics-port", "0", "--metrics-addr", "127.0.0.1")
    assert local.metrics_addr == "127.0.0.1"


@pytest.mark.parametrize("name, raw, phrase", [
    ("ELASTIC_RUN_VERBOSE", "abc", "ELASTIC_RUN_VERBOSE='abc' is not a whole number"),
    ("ELASTIC_RUN_STANDALONE", "maybe", "is not a boolean"),
    ("ELASTIC_RUN_SETTLE", "soon", "ELASTIC_RUN_SETTLE='soon' is not a number"),
])
def test_bad_environment_values(tmp_path, name, raw, phrase):
    with pytest.raises(ConfigError, match=phrase):
        config_for(tmp_path, environ={name: raw})


def test_tls_half_pair_is_refused_before_grpc(tmp_path):
    pem = tmp_path / "cert.pem"
    pem.write_text("x")
    for flags, phrase in ((["--etcd-cert", str(pem)], "--etcd-cert needs --etcd-key"),
                          (["--etcd-key", str(pem)], "--etcd-key needs --etcd-cert")):
        with pytest.raises(ConfigError, match=phrase):
            config_for(tmp_path, "--rdzv-endpoints", "https://127.0.0.1:1", *flags)



@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "10.0.0.1", "192.0.2.1", "::1"])
def test_a_master_address_that_resolves_is_taken_even_when_not_this_machines(host):
    assert check_master_addr(host) == host  # behind NAT the published address is not ours


@pytest.mark.parametrize("host", ["a b", "h\nx", "", "x" * 300])
def test_a_master_address_that_resolves_nowhere_is_one_clear_error(host):
    with pytest.raises(ConfigError, match="does not resolve") as info:
        check_master_addr(host)
    assert "\n" not in str(info.value)
