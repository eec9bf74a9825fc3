"""--notice-from / --notice-url: parsing, environment defaults, one-line errors (no I/O)."""

from __future__ import annotations

import pytest

from elastic_runner.cli import flags, main as cli, run
from elastic_runner.config import CloudNoticeConfig
from elastic_runner.errors import ConfigError


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return str(path)


def config_for(argv, environ=None):
    environ = environ or {}
    return run.build_config(flags.parse_args(argv, environ), environ, 0)


def test_off_by_default(script):
    assert config_for([script]).cloud_notice is None


@pytest.mark.parametrize("cloud, url", [
    ("aws", "http://169.254.169.254"),
    ("gcp", "http://metadata.google.internal"),
    ("azure", "http://169.254.169.254"),
])
def test_each_cloud_gets_its_documented_address(script, cloud, url):
    assert config_for(["--notice-from", cloud, script]).cloud_notice == \
        CloudNoticeConfig(cloud, url, interval_s=1.0, timeout_s=1.0)


def test_defaults_poll_every_second_or_two_with_a_short_timeout(script):
    notice = config_for(["--notice-from", "aws", script]).cloud_notice
    assert 1.0 <= notice.interval_s <= 2.0 and 0 < notice.timeout_s <= 1.0


def test_cloud_name_is_case_insensitive(script):
    assert config_for(["--notice-from", "GCP", script]).cloud_notice.cloud == "gcp"


@pytest.mark.parametrize("given, expected", [
    ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
    ("http://127.0.0.1:8080/", "http://127.0.0.1:8080"),
    ("https://relay.internal/meta/", "https://relay.internal/meta"),
])
def test_notice_url_sets_the_base(script, given, expected):
    notice = config_for(["--notice-from", "azure", "--notice-url", given, script]).cloud_notice
    assert notice.base_url == expected and notice.cloud == "azure"


def test_environment_sets_both(script):
    environ = {"ELASTIC_RUN_NOTICE_FROM": "aws", "ELASTIC_RUN_NOTICE_URL": "http://127.0.0.1:9"}
    assert config_for([script], environ).cloud_notice == \
        CloudNoticeConfig("aws", "http://127.0.0.1:9")


def test_command_line_wins_over_environment(script):
    environ = {"ELASTIC_RUN_NOTICE_FROM": "aws"}
    assert config_for(["--notice-from", "gcp", script], environ).cloud_notice.cloud == "gcp"


def test_empty_environment_value_means_off(script):
    assert config_for([script], {"ELASTIC_RUN_NOTICE_FROM": ""}).cloud_notice is None


def test_url_without_cloud_is_one_line_exit_2(script):
    with pytest.raises(ConfigError) as info:
        config_for(["--notice-url", "http://127.0.0.1:9", script])
    assert "--notice-url" in str(info.value) and "--notice-from" in str(info.value)
    assert "\n" not in str(info.value) and info.value.exit_code == 2


def test_url_from_environment_without_cloud_is_refused(script):
    with pytest.raises(ConfigError, match="needs --notice-from"):
        config_for([script], {"ELASTIC_RUN_NOTICE_URL": "http://127.0.0.1:9"})


def test_unknown_cloud_from_environment_is_one_line(script):
    with pytest.raises(ConfigError) as info:
        config_for([script], {"ELASTIC_RUN_NOTICE_FROM": "awz"})
    assert "'awz'" in str(info.value) and "aws, gcp, azure" in str(info.value)
    assert info.value.exit_code == 2


def test_unknown_cloud_on_command_line_is_argparse_exit_2(script, capsys):
    with pytest.raises(SystemExit) as info:
        flags.parse_args(["--notice-from", "oracle", script], {})
    assert info.value.code == 2
    assert "--notice-from" in capsys.readouterr().err


@pytest.mark.parametrize("url", [
    "169.254.169.254",             # no scheme
    "ftp://169.254.169.254",
    "http://",                     # no host
    "http://127.0.0.1:99999",      # no such port
    "http://127.0.0.1:0",
    "http://127.0.0.1:8080/?x=1",  # the path is the cloud's, not the user's
    "http://user:pw@127.0.0.1",
])
def test_bad_url_is_one_line(script, url):
    with pytest.raises(ConfigError) as info:
        config_for(["--notice-from", "aws", "--notice-url", url, script])
    assert str(info.value).startswith("--notice-url ")
    assert "\n" not in str(info.value) and info.value.exit_code == 2


def test_main_exits_2_with_one_line(script, capsys):
    assert cli.main(["--notice-url", "http://127.0.0.1:9", script]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("elastic-run: error: --notice-url")


def test_flags_are_in_the_help():
    names = {name for row in flags.RUN_FLAGS for name in row.names}
    assert {"--notice-from", "--notice-url"} <= names
    text = flags.build_parser().format_help()
    assert "--notice-from {aws,gcp,azure}" in text and "--notice-url URL" in text
