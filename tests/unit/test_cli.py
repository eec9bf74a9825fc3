"""Command-line parsing: flags, environment defaults, derived configuration (no etcd)."""

from __future__ import annotations

import sys

import pytest

from elastic_runner.cli import flags, run
from elastic_runner.errors import ConfigError


def parse(argv: list[str], environ: dict[str, str] | None = None):
    return flags.parse_args(argv, environ or {})


def config_for(argv: list[str], environ: dict[str, str] | None = None, gpu_count: int = 0):
    environ = environ or {}
    return run.build_config(parse(argv, environ), environ, gpu_count)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return str(path)


# ---- node counts ----------------------------------------------------------------
@pytest.mark.parametrize("argv, expected", [
    (["--nnodes", "3"], (3, 3)),
    (["--nnodes", "1"], (1, 1)),
    (["--nnodes", "2:5"], (2, 5)),
    (["--nnodes", "4:4"], (4, 4)),
    ([], (1, 1)),
    (["--min-nodes", "3"], (3, 3)),  # max defaults to min
    (["--max-nodes", "4"], (1, 4)),  # min defaults to 1
    (["--min-nodes", "2", "--max-nodes", "6"], (2, 6)),
    (["--standalone"], (1, 1)),
])
def test_parse_nodes(argv, expected):
    assert flags.parse_nodes(parse([*argv, "train.py"])) == expected


@pytest.mark.parametrize("argv, phrase", [
    (["--min-nodes", "3", "--max-nodes", "2"], "--min-nodes 3 is greater than --max-nodes 2"),
    (["--nnodes", "5:2"], "--min-nodes 5 is greater than --max-nodes 2"),
    (["--min-nodes", "0"], "at least 1"),
    (["--nnodes", "0"], "at least 1"),
    (["--nnodes", "two"], "MIN:MAX"),
    (["--nnodes", "1:x"], "MIN:MAX"),
    (["--nnodes", "2", "--min-nodes", "2"], "either --nnodes or --min-nodes"),
    (["--nnodes", "1:3", "--max-nodes", "3"], "either --nnodes or --min-nodes"),
])
def test_parse_nodes_rejects(argv, phrase):
    with pytest.raises(ConfigError, match=None) as info:
        flags.parse_nodes(parse([*argv, "train.py"]))
    assert phrase in str(info.value)
    assert info.value.exit_code == 2


# ---- workers per node -----------------------------------------------------------
@pytest.mark.parametrize("text, gpus, expected", [
    ("auto", 0, 1),
    ("auto", 4, 4),
    ("gpu", 0, 1),
    ("gpu", 2, 2),
    ("cpu", 8, 1),
    ("1", 0, 1),
    ("3", 8, 3),
])
def test_parse_nproc(text, gpus, expected):
    assert flags.parse_nproc(text, gpus) == expected


@pytest.mark.parametrize("text", ["0", "-1", "two", "", "1.5"])
def test_parse_nproc_rejects(text):
    with pytest.raises(ConfigError) as info:
        flags.parse_nproc(text, 4)
    assert "--nproc-per-node" in str(info.value)


@pytest.mark.parametrize("gpus, expected", [(0, 1), (4, 4)])
def test_build_config_nproc_auto(script, gpus, expected):
    config = config_for(["--nproc-per-node", "auto", script], gpu_count=gpus)
    assert config.workers.nproc == expected
    assert config.workers.gpu_count == gpus


def test_nproc_underscore_alias(script):
    assert config_for(["--nproc_per_node", "2", script]).workers.nproc == 2


# ---- environment defaults -------------------------------------------------------
def test_env_defaults_apply(script):
    environ = {
        "ELASTIC_RUN_MIN_NODES": "2", "ELASTIC_RUN_MAX_NODES": "4",
        "ELASTIC_RUN_NPROC_PER_NODE": "3", "ELASTIC_RUN_RUN_ID": "from-env",
        "ELASTIC_RUN_LEASE_TTL": "9", "ELASTIC_RUN_MAX_RESTARTS": "7",
        "ELASTIC_RUN_NODE_ID": "env-node", "ELASTIC_RUN_MASTER_ADDR": "10.9.8.7",
    }
    config = config_for([script], environ)
    assert (config.rendezvous.min_nodes, config.rendezvous.max_nodes) == (2, 4)
    assert config.workers.nproc == 3
    assert config.rendezvous.run_id == "from-env"
    assert config.rendezvous.lease_ttl_s == 9
    assert config.max_restarts == 7
    assert config.rendezvous.node_id == "env-node"
    assert config.rendezvous.node_addr == "10.9.8.7"


def test_command_line_wins_over_env(script):
    environ = {"ELASTIC_RUN_MIN_NODES": "2", "ELASTIC_RUN_MAX_NODES": "4",
               "ELASTIC_RUN_NPROC_PER_NODE": "3", "ELASTIC_RUN_RUN_ID": "from-env"}
    config = config_for(["--min-nodes", "1", "--max-nodes", "5", "--nproc-per-node", "2",
                         "--run-id", "from-flag", script], environ)
    assert (config.rendezvous.min_nodes, config.rendezvous.max_nodes) == (1, 5)
    assert config.workers.nproc == 2
    assert config.rendezvous.run_id == "from-flag"


def test_command_line_min_max_wins_over_env_nnodes():
    # --nnodes from the environment must not clash with --min/--max-nodes given on the
    # command line: the command line wins over the environment.
    args = parse(["--min-nodes", "2", "--max-nodes", "3", "train.py"],
                 {"ELASTIC_RUN_NNODES": "1:4"})
    assert flags.parse_nodes(args) == (2, 3)


def test_command_line_nnodes_wins_over_env_min_nodes():
    args = parse(["--nnodes", "3", "train.py"], {"ELASTIC_RUN_MIN_NODES": "2"})
    assert flags.parse_nodes(args) == (3, 3)


@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("0", False),
                                             ("no", False)])
def test_env_boolean_flag(value, expected):
    args = parse(["train.py"], {"ELASTIC_RUN_STANDALONE": value})
    assert args.standalone is expected


def test_env_nnodes_range():
    assert flags.parse_nodes(parse(["train.py"], {"ELASTIC_RUN_NNODES": "2:3"})) == (2, 3)


def test_env_bad_integer_is_config_error():
    parser = flags.build_parser()
    with pytest.raises(ConfigError) as info:
        flags.apply_env_defaults(parser, {"ELASTIC_RUN_MIN_NODES": "abc"})
    assert "ELASTIC_RUN_MIN_NODES" in str(info.value)


def test_unrelated_env_ignored(script):
    config = config_for([script], {"ELASTIC_RUN_NO_SUCH_FLAG": "1", "MIN_NODES": "9"})
    assert (config.rendezvous.min_nodes, config.rendezvous.max_nodes) == (1, 1)


# ---- run id ---------------------------------------------------------------------
def test_default_run_id_stable_for_same_command(script):
    first = config_for([script, "--lr", "0.1"]).rendezvous.run_id
    second = config_for([script, "--lr", "0.1"]).rendezvous.run_id
    assert first == second
    assert first.startswith("train-")


def test_default_run_id_differs_with_args(script, tmp_path):
    base = config_for([script, "--lr", "0.1"]).rendezvous.run_id
    assert config_for([script, "--lr", "0.2"]).rendezvous.run_id != base
    assert config_for([script]).rendezvous.run_id != base
    other = tmp_path / "other.py"
    other.write_text("pass\n")
    assert config_for([str(other), "--lr", "0.1"]).rendezvous.run_id != base


def test_explicit_run_id_used(script):
    assert config_for(["--run-id", "job-7", script]).rendezvous.run_id == "job-7"
    assert config_for(["--rdzv-id", "job-8", script]).rendezvous.run_id == "job-8"


# ---- script and its arguments ---------------------------------------------------
@pytest.mark.parametrize("argv, entrypoint, args", [
    (["train.py", "--lr", "0.1"], "train.py", ["--lr", "0.1"]),
    (["--", "train.py", "--lr", "0.1"], "train.py", ["--lr", "0.1"]),
    (["train.py"], "train.py", []),
    # flags after the script belong to the script, even ones the launcher knows
    (["--nproc-per-node", "2", "train.py", "--max-restarts", "5", "-m", "x", "-v"],
     "train.py", ["--max-restarts", "5", "-m", "x", "-v"]),
    (["-m", "pkg.mod", "--epochs", "3"], "pkg.mod", ["--epochs", "3"]),
    # argparse drops the first '--' after the script (deploy's renderer relies on it)
    (["train.py", "--", "--lr", "1"], "train.py", ["--lr", "1"]),
    (["train.py", "--", "--", "x"], "train.py", ["--", "x"]),
    (["train.py", "a", "--", "b"], "train.py", ["a", "--", "b"]),
])
def test_script_args_pass_through(argv, entrypoint, args):
    parsed = parse(argv)
    assert parsed.entrypoint == entrypoint
    assert parsed.args == args


@pytest.mark.parametrize("argv", [
    ["--log-dir=--", "train.py"],
    ["--run-id=--", "train.py"],
    ["--node-label=--", "train.py"],
    ["--node-label", "zone=a", "--node-label=--", "train.py"],
    ["--notice-file=--", "train.py"],
    ["-m", "--log-dir=--", "pkg.mod"],
])
def test_a_flag_value_argparse_swallows_is_refused(argv):
    """Python 3.11's argparse turns `--flag=--` into [] without calling the flag's type."""
    with pytest.raises(ConfigError) as info:
        parse(argv)
    assert str(info.value).startswith(next(a for a in argv if a.endswith("=--"))[:-3] + " got '--'")
    assert "\n" not in str(info.value) and info.value.exit_code == 2


def test_a_script_argument_that_looks_like_that_is_the_scripts():
    assert parse(["train.py", "--log-dir=--"]).args == ["--log-dir=--"]
    assert parse(["train.py", "--", "--log-dir=--"]).args == ["--log-dir=--"]
    assert parse(["--", "train.py", "--log-dir=--"]).args == ["--log-dir=--"]


def test_script_flags_after_script_do_not_change_launcher(script):
    config = config_for([script, "--max-restarts", "9", "--nproc-per-node", "4"])
    assert config.max_restarts == 3
    assert config.workers.nproc == 1
    assert config.workers.argv == (sys.executable, "-u", script, "--max-restarts", "9",
                                   "--nproc-per-node", "4")


def test_worker_argv_for_script(script):
    config = config_for([script, "--lr", "0.1"])
    assert config.workers.argv == (sys.executable, "-u", script, "--lr", "0.1")


def test_worker_argv_for_module():
    config = config_for(["-m", "json.tool", "--indent", "2"])
    assert config.workers.argv == (sys.executable, "-u", "-m", "json.tool", "--indent", "2")


def test_fingerprint_tracks_script_and_args(script, tmp_path):
    base = config_for([script, "--lr", "0.1"]).workers.fingerprint
    assert config_for([script, "--lr", "0.1"]).workers.fingerprint == base
    assert config_for([script, "--lr", "0.2"]).workers.fingerprint != base
    (tmp_path / "train.py").write_text("print('changed')\n")
    assert config_for([script, "--lr", "0.1"]).workers.fingerprint != base


def test_missing_script_is_config_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        config_for([str(tmp_path / "nope.py")])
    assert "script not found" in str(info.value)


def test_missing_module_is_config_error():
    with pytest.raises(ConfigError) as info:
        config_for(["-m", "no_such_module_xyz"])
    assert "not importable" in str(info.value)


# ---- endpoints and other values -------------------------------------------------
def test_endpoints_split_and_stripped(script):
    config = config_for(["--rdzv-endpoints", " http://127.0.0.1:2379 , http://127.0.0.2:2380,",
                         "--master-addr", "10.0.0.1", script])
    assert config.etcd.endpoints == ("http://127.0.0.1:2379", "http://127.0.0.2:2380")


def test_no_endpoints_means_embedded(script):
    config = config_for([script])
    assert config.etcd.endpoints == ()
    assert config.rendezvous.node_addr == "127.0.0.1"


def test_standalone_ignores_endpoints(script):
    config = config_for(["--standalone", "--rdzv-endpoints", "http://10.0.0.1:2379", script])
    assert config.etcd.endpoints == ()
    assert (config.rendezvous.min_nodes, config.rendezvous.max_nodes) == (1, 1)


@pytest.mark.parametrize("endpoint", ["http://:abc", "ftp://host:2379", "http://host:99999"])
def test_malformed_endpoint_is_config_error(script, endpoint):
    with pytest.raises(ConfigError) as info:
        config_for(["--rdzv-endpoints", endpoint, "--master-addr", "10.0.0.1", script])
    assert "malformed etcd endpoint" in str(info.value)


def test_lease_ttl_must_be_positive(script):
    with pytest.raises(ConfigError) as info:
        config_for(["--lease-ttl", "0", script])
    assert "--lease-ttl" in str(info.value)


def test_flag_values_reach_config(script, tmp_path):
    config = config_for(["--min-nodes", "2", "--max-nodes", "3", "--node-id", "n1",
                         "--lease-ttl", "7", "--join-timeout", "30", "--settle", "0.5",
                         "--master-addr", "10.1.1.1", "--master-port", "29555",
                         "--max-restarts", "4", "--log-dir", str(tmp_path / "logs"),
                         "--etcd-timeout", "2.5", "-q", script])
    r = config.rendezvous
    assert (r.node_id, r.lease_ttl_s, r.join_timeout_s, r.settle_s) == ("n1", 7, 30.0, 0.5)
    assert (r.node_addr, r.master_port) == ("10.1.1.1", 29555)
    assert config.max_restarts == 4
    assert config.workers.log_dir == tmp_path / "logs"
    assert config.etcd.timeout_s == 2.5
    assert config.verbosity == 0



def test_suspect_grace_from_flag_env_and_default(script):
    """--suspect-grace (issue 15): flag over ELASTIC_RUN_SUSPECT_GRACE over 1 s."""
    assert config_for([script]).rendezvous.suspect_grace_s == 1.0
    environ = {"ELASTIC_RUN_SUSPECT_GRACE": "0.25"}
    assert config_for([script], environ).rendezvous.suspect_grace_s == 0.25
    assert config_for(["--suspect-grace", "0", script], environ).rendezvous.suspect_grace_s == 0
    with pytest.raises(ConfigError) as info:
        config_for(["--suspect-grace", "-1", script])
    assert str(info.value) == "--suspect-grace -1: need 0 or more seconds"


# ---- password -------------------------------------------------------------------
def test_password_from_file_not_in_repr(script, tmp_path):
    secret = tmp_path / "pw"
    secret.write_text("s3cr3t-from-file\n")
    config = config_for(["--etcd-user", "root", "--etcd-password-file", str(secret), script])
    assert config.etcd.password == "s3cr3t-from-file"
    assert config.etcd.user == "root"
    assert "s3cr3t-from-file" not in repr(config)
    assert "s3cr3t-from-file" not in repr(config.etcd)


def test_password_from_env_not_in_repr(script):
    environ = {"ELASTIC_RUN_ETCD_PASSWORD": "s3cr3t-from-env"}
    config = config_for(["--etcd-user", "root", script], environ)
    assert config.etcd.password == "s3cr3t-from-env"
    assert "s3cr3t-from-env" not in repr(config)


def test_no_password_by_default(script):
    assert config_for([script]).etcd.password is None


def test_password_file_wins_over_env(script, tmp_path):
    secret = tmp_path / "pw"
    secret.write_text("from-file")
    config = config_for(["--etcd-password-file", str(secret), script],
                        {"ELASTIC_RUN_ETCD_PASSWORD": "from-env"})
    assert config.etcd.password == "from-file"


def test_unreadable_password_file_is_config_error(script, tmp_path):
    with pytest.raises(ConfigError) as info:
        config_for(["--etcd-password-file", str(tmp_path / "missing"), script])
    assert "--etcd-password-file" in str(info.value)


def test_password_is_never_a_flag_value(script):
    # There is no --etcd-password; a secret typed as one must not become the password
    # and must not be echoed back in the error.
    with pytest.raises((ConfigError, SystemExit)) as info:
        config_for(["--etcd-password", "s3cr3t-typed", script])
    assert "s3cr3t-typed" not in str(info.value)


@pytest.mark.parametrize("key, store", [
    ("/elastic-runner/v2/job/rounds/3/store/rank0", True),
    ("/elastic-runner/v2/store/round", False),  # a run named "store": its round matters
    ("/elastic-runner/v2/store/rounds/2/plan", False),
    ("/elastic-runner/v2/store/rounds/2/store/key", True),
    ("/elastic-runner/v2/job/nodes/store", False),
])
def test_status_watch_ignores_only_torch_store_keys(key, store):
    from elastic_runner.cli.status import is_store_key
    assert is_store_key(key) is store


@pytest.mark.parametrize("text, expected", [
    ("zone=us-east-1c", ("zone", "us-east-1c")),
    ("lifecycle=on-demand", ("lifecycle", "on-demand")),
    (" rack = r12 ", ("rack", "r12")),
    ("topology.kubernetes.io/zone=eu-west-1a", ("topology.kubernetes.io/zone", "eu-west-1a")),
    ("instance=p4d.24xlarge", ("instance", "p4d.24xlarge")),
    ("zone=", ("zone", "")),
])
def test_node_labels_cloud_and_kubernetes_use_are_accepted(text, expected):
    assert flags.parse_label(text, "--node-label") == expected


@pytest.mark.parametrize("text, phrase", [
    ("zone=a\nb", "a value is"),            # would forge a line in every node's log
    ("zone=a,rack=b", "a value is"),        # reads as two labels where it is printed
    ("k=v=w", "a value is"),
    ("zone=a b", "a value is"),
    ("zone=" + "x" * 129, "a value is"),
    ("ke y=v", "a key is"),
    ("-k=v", "a key is"),
    ("=v", "use KEY=VALUE"),
    ("zone", "use KEY=VALUE"),
])
def test_node_labels_that_would_garble_the_plan_line_are_refused(text, phrase):
    with pytest.raises(ConfigError, match=phrase):
        flags.parse_label(text, "--node-label")
