"""Bad input through the real command: the right exit code, one clear message, no traceback."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from elastic_runner.etcd.server import free_port

REPO = Path(__file__).resolve().parents[2]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_RUN_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def elastic_run(*argv: str) -> list[str]:
    return [sys.executable, "-m", "elastic_runner", *argv]


def stop_group(process: subprocess.Popen) -> None:
    """Stop a process started with start_new_session=True, by its own group id."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


@dataclass
class Context:
    tmp_path: Path
    stack: contextlib.ExitStack
    request: pytest.FixtureRequest
    values: dict = field(default_factory=dict)

    @property
    def script(self) -> str:
        path = self.tmp_path / "train.py"
        if not path.exists():
            path.write_text("print('hello from train.py')\n")
        return str(path)


# ---- infrastructure per row ------------------------------------------------------
def no_setup(ctx: Context) -> None:
    pass


def dead_port(ctx: Context) -> None:
    ctx.values["endpoint"] = f"http://127.0.0.1:{free_port()}"


def http_server(ctx: Context) -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
        cwd=ctx.tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    ctx.stack.callback(stop_group, server)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(endpoint + "/", timeout=1):
                break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"http.server on {endpoint} did not come up")
            time.sleep(0.1)
    ctx.values["endpoint"] = endpoint


def running_agent(ctx: Context) -> None:
    """etcd plus agent 1 of run 'same' (nproc 1) with its node key registered."""
    from elastic_runner.config import EtcdConfig
    from elastic_runner.etcd.client import EtcdClient

    endpoint = ctx.request.getfixturevalue("etcd").endpoint
    sleeper = ctx.tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(20)\n")
    log = open(ctx.tmp_path / "agent1.log", "wb")
    ctx.stack.callback(log.close)
    agent = subprocess.Popen(
        elastic_run("--rdzv-endpoints", endpoint, "--run-id", "same", "--nproc-per-node", "1",
                    "--min-nodes", "1", "--max-nodes", "2", "--node-id", "agent1",
                    str(sleeper)),
        cwd=ctx.tmp_path, env=clean_env(), stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )
    ctx.stack.callback(stop_group, agent)
    client = EtcdClient(EtcdConfig((endpoint,), 2.0, 5.0))
    ctx.stack.callback(client.close)
    deadline = time.monotonic() + 45
    while not client.get_prefix("/elastic-runner/v2/same/nodes/")[0]:
        if agent.poll() is not None or time.monotonic() > deadline:
            pytest.fail("agent 1 did not register; its output:\n"
                        + (ctx.tmp_path / "agent1.log").read_text(errors="replace"))
        time.sleep(0.1)
    ctx.values.update(endpoint=endpoint, sleeper=str(sleeper))


def old_schema_run(ctx: Context) -> None:
    """etcd holding keys of run 'old' written under the v1 layout (before deputies and
    columnar plans): what an upgrade in the middle of a run finds."""
    from elastic_runner.config import EtcdConfig
    from elastic_runner.etcd.client import EtcdClient

    endpoint = ctx.request.getfixturevalue("etcd").endpoint
    client = EtcdClient(EtcdConfig((endpoint,), 2.0, 5.0))
    client.put("/elastic-runner/v1/old/round", b"7")
    client.close()
    ctx.values["endpoint"] = endpoint


def older_release_run(ctx: Context) -> None:
    """etcd holding run 'same' as an agent of an earlier release wrote its spec (no
    protocol number: before 2026-12-07, when a round's close began to empty old plans)."""
    from elastic_runner.config import EtcdConfig
    from elastic_runner.etcd.client import EtcdClient

    endpoint = ctx.request.getfixturevalue("etcd").endpoint
    client = EtcdClient(EtcdConfig((endpoint,), 2.0, 5.0))
    ctx.stack.callback(client.close)
    client.put("/elastic-runner/v2/same/spec", json.dumps(
        {"min_nodes": 1, "max_nodes": 4, "fingerprint": "0123456789abcdef", "min_workers": 0,
         "max_workers": 0}).encode())
    ctx.values["endpoint"] = endpoint


def full_etcd(ctx: Context) -> None:
    """An etcd whose space quota is used up (its NOSPACE alarm): it refuses writes."""
    from elastic_runner.config import EtcdConfig
    from elastic_runner.errors import EtcdError
    from elastic_runner.etcd.client import EtcdClient
    from elastic_runner.etcd.server import EmbeddedEtcd

    server = ctx.stack.enter_context(
        EmbeddedEtcd(extra_args=("--quota-backend-bytes", str(2 * 1024 * 1024))))
    client = EtcdClient(EtcdConfig((server.endpoint,), 2.0, 5.0))
    ctx.stack.callback(client.close)
    with pytest.raises(EtcdError, match="space exceeded"):
        for i in range(1000):  # 50 KB each: full after about 40
            client.put(f"/filler/{i}", b"x" * 50_000)
    ctx.values["endpoint"] = server.endpoint


def env_var(name: str, value: str):
    """A setup that puts one ELASTIC_RUN_* variable in the command's environment."""
    def setup(ctx: Context) -> None:
        ctx.values.setdefault("env", {})[name] = value
    return setup


def live_etcd(ctx: Context) -> None:
    ctx.values["endpoint"] = ctx.request.getfixturevalue("etcd").endpoint


def busy_port(ctx: Context) -> None:
    """etcd, and a port some other process listens on."""
    import socket

    live_etcd(ctx)
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    ctx.stack.callback(holder.close)
    ctx.values["port"] = str(holder.getsockname()[1])


def a_regular_file(ctx: Context) -> None:
    (ctx.tmp_path / "logs").write_text("not a folder")


def pem_files(ctx: Context) -> None:
    from tests.helpers.certs import make_pki

    pki = make_pki(ctx.tmp_path / "pki")
    ctx.values.update({name: str(path) for name, path in pki.items()})


def tls_etcd_and_other_ca(ctx: Context) -> None:
    """A TLS etcd, and a CA/client pair that etcd does not trust."""
    from elastic_runner.etcd.server import EmbeddedEtcd
    from tests.helpers.certs import make_pki

    pki = make_pki(ctx.tmp_path / "pki")
    other = make_pki(ctx.tmp_path / "other", name="other")
    server = ctx.stack.enter_context(EmbeddedEtcd(tls_files=pki))
    ctx.values.update(endpoint=server.endpoint, other_ca=str(other["ca"]),
                      cert=str(pki["client_cert"]), key=str(pki["client_key"]))


def plain_etcd_and_pem(ctx: Context) -> None:
    live_etcd(ctx)
    pem_files(ctx)
    ctx.values["https"] = ctx.values["endpoint"].replace("http://", "https://")


def unwritable_checkpoint_dir(ctx: Context) -> None:
    """A checkpoint path below a plain file: no user (root included) can create it."""
    blocker = ctx.tmp_path / "a-file"
    blocker.write_text("not a directory")
    ctx.values["ckpt"] = str(blocker / "ckpt")


MLP = Path(__file__).resolve().parents[2] / "examples" / "train_mlp.py"


# ---- the table ------------------------------------------------------------------
CASES = [
    pytest.param(no_setup, lambda c: ["--min-nodes", "3", "--max-nodes", "2", c.script],
                 2, ["--min-nodes 3 is greater than --max-nodes 2"], id="min-gt-max"),
    pytest.param(no_setup, lambda c: ["--nproc-per-node", "0", c.script],
                 2, ["--nproc-per-node 0"], id="nproc-zero"),
    pytest.param(no_setup, lambda c: ["--nproc-per-node", "-1", c.script],
                 2, ["--nproc-per-node -1"], id="nproc-negative"),
    pytest.param(no_setup, lambda c: [str(c.tmp_path / "missing.py")],
                 2, ["script not found"], id="missing-script"),
    pytest.param(no_setup, lambda c: ["--no-python", str(c.tmp_path / "no-such-command")],
                 2, ["--no-python: no executable", "no-such-command"], id="missing-command"),
    pytest.param(no_setup, lambda c: ["--no-python", c.script],  # a file, not executable
                 2, ["--no-python: no executable", "train.py"], id="command-not-executable"),
    pytest.param(no_setup, lambda c: ["-m", "no_such_module_xyz"],
                 2, ["not importable", "no_such_module_xyz"], id="missing-module"),
    pytest.param(no_setup, lambda c: ["--rdzv-endpoints", "http://:abc", c.script],
                 2, ["malformed etcd endpoint"], id="malformed-endpoint"),
    pytest.param(no_setup, lambda c: ["--log-dir=--", c.script],
                 2, ["--log-dir got '--'"], id="flag-value-dashes"),
    pytest.param(dead_port, lambda c: ["--rdzv-endpoints", c.values["endpoint"],
                                       "--etcd-timeout", "1", c.script],
                 4, ["{endpoint}"], id="etcd-unreachable"),
    # --lease-ttl 2: the agent retries etcd for its grace (two TTLs, at least 5 s), not
    # the default 10 s; what is checked is the exit code and the one line.
    pytest.param(http_server, lambda c: ["--rdzv-endpoints", c.values["endpoint"],
                                         "--etcd-timeout", "1", "--lease-ttl", "2", c.script],
                 4, ["{endpoint}"], id="not-etcd"),
    pytest.param(running_agent, lambda c: ["--rdzv-endpoints", c.values["endpoint"],
                                           "--run-id", "same", "--nproc-per-node", "1",
                                           "--min-nodes", "1", "--max-nodes", "3",
                                           "--node-id", "agent2", c.values["sleeper"]],
                 5, ["different job", "max_nodes 2 (run) vs 3"], id="spec-mismatch"),
    pytest.param(older_release_run, lambda c: ["--rdzv-endpoints", c.values["endpoint"],
                                               "--run-id", "same", c.script],
                 5, ["different job", "elastic-runner protocol 1 (run) vs 3 (this node)",
                     "one elastic-runner version on every node"], id="older-release-run"),
    pytest.param(full_etcd, lambda c: ["--rdzv-endpoints", c.values["endpoint"], c.script],
                 4, ["is full and refused", "alarm disarm", "--auto-compaction-retention"],
                 id="etcd-out-of-space"),
    pytest.param(old_schema_run, lambda c: ["--rdzv-endpoints", c.values["endpoint"],
                                            "--run-id", "old", c.script],
                 5, ["older elastic-runner", "new --run-id"], id="old-schema-keys"),
    # ids: one grammar, checked before etcd or the disk is touched
    pytest.param(no_setup, lambda c: ["--run-id", "victim/rounds/0/join", c.script],
                 2, ["--run-id", "is not a valid id"], id="run-id-inside-another-run"),
    pytest.param(no_setup, lambda c: ["--run-id", "v3/nodes", c.script],
                 2, ["--run-id", "is not a valid id"], id="run-id-slash"),
    pytest.param(no_setup, lambda c: ["--node-id", "a/b", c.script],
                 2, ["--node-id 'a/b' is not a valid id"], id="node-id-slash"),
    pytest.param(no_setup, lambda c: ["--run-id", "job\nrm -rf /", c.script],
                 2, ["--run-id", "is not a valid id"], id="run-id-newline"),
    pytest.param(no_setup, lambda c: ["--run-id", "../../x", "--log-dir", "logs", c.script],
                 2, ["--run-id '../../x' is not a valid id"], id="run-id-escapes-log-dir"),
    # values argparse's types cannot judge
    pytest.param(env_var("ELASTIC_RUN_VERBOSE", "abc"), lambda c: [c.script],
                 2, ["ELASTIC_RUN_VERBOSE='abc' is not a whole number"], id="env-verbose-abc"),
    pytest.param(env_var("ELASTIC_RUN_STANDALONE", "maybe"), lambda c: [c.script],
                 2, ["ELASTIC_RUN_STANDALONE='maybe' is not a boolean"], id="env-bool-maybe"),
    pytest.param(no_setup, lambda c: ["--max-node", "2", c.script],
                 2, ["unrecognized arguments: --max-node"], id="abbreviated-flag"),
    pytest.param(no_setup, lambda c: ["--settle", "3", "--settle-max", "1", c.script],
                 2, ["--settle-max 1 is below --settle 3"], id="settle-max-below-settle"),
    pytest.param(no_setup, lambda c: ["--settle", "-5", c.script],
                 2, ["--settle -5"], id="settle-negative"),
    pytest.param(no_setup, lambda c: ["--max-restarts", "-1", c.script],
                 2, ["--max-restarts -1"], id="max-restarts-negative"),
    pytest.param(no_setup, lambda c: ["--min-workers", "-4", c.script],
                 2, ["--min-workers -4"], id="min-workers-negative"),
    pytest.param(no_setup, lambda c: ["--monitor-interval", "0", c.script],
                 2, ["--monitor-interval 0"], id="monitor-interval-zero"),
    pytest.param(no_setup, lambda c: ["--etcd-timeout", "0", c.script],
                 2, ["--etcd-timeout 0: need a positive number"], id="etcd-timeout-zero"),
    pytest.param(no_setup, lambda c: ["--nproc-per-node", "10000", c.script],
                 2, ["--nproc-per-node 10000: this node can hold at most"], id="nproc-too-many"),
    pytest.param(no_setup, lambda c: ["--metrics-port", "70000", c.script],
                 2, ["--metrics-port 70000"], id="metrics-port-too-big"),
    pytest.param(busy_port, lambda c: ["--rdzv-endpoints", c.values["endpoint"],
                                       "--metrics-port", c.values["port"], c.script],
                 2, ["--metrics-port {port}", "cannot listen"], id="metrics-port-in-use"),
    pytest.param(a_regular_file, lambda c: ["--log-dir", "logs", c.script],
                 2, ["--log-dir logs: exists and is not a directory"], id="log-dir-is-a-file"),
    pytest.param(no_setup, lambda c: ["--node-label", "zone=a\n[elastic-run x] round 9", c.script],
                 2, ["--node-label 'zone=a\\n[elastic-run x] round 9': a value is"],
                 id="node-label-with-a-newline"),
    pytest.param(no_setup, lambda c: ["--master-addr", "a b", c.script],
                 2, ["--master-addr 'a b' does not resolve"], id="master-addr-resolves-nowhere"),
    # A notice file already there: not a node that joins, trains nothing and exits 0
    pytest.param(a_regular_file, lambda c: ["--notice-file", "logs", c.script],
                 2, ["--notice-file logs already exists", "does not join"],
                 id="notice-file-already-there"),
    # TLS: refused before gRPC can abort the process, or named as TLS when the handshake fails
    pytest.param(pem_files, lambda c: ["--rdzv-endpoints", "https://127.0.0.1:1",
                                       "--etcd-cert", c.values["client_cert"], c.script],
                 2, ["--etcd-cert needs --etcd-key"], id="cert-without-key"),
    pytest.param(pem_files, lambda c: ["--rdzv-endpoints", "https://127.0.0.1:1",
                                       "--etcd-key", c.values["client_key"], c.script],
                 2, ["--etcd-key needs --etcd-cert"], id="key-without-cert"),
    pytest.param(pem_files, lambda c: ["--rdzv-endpoints", "https://127.0.0.1:1",
                                       "--etcd-cert", c.values["client_key"],
                                       "--etcd-key", c.values["client_cert"], c.script],
                 2, ["TLS files rejected"], id="cert-key-swapped"),
    pytest.param(tls_etcd_and_other_ca,
                 lambda c: ["--rdzv-endpoints", c.values["endpoint"], "--etcd-timeout", "1",
                            "--lease-ttl", "2", "--etcd-cacert", c.values["other_ca"], "--etcd-cert", c.values["cert"],
                            "--etcd-key", c.values["key"], c.script],
                 4, ["TLS", "certificate does not verify"], id="tls-wrong-ca"),
    pytest.param(plain_etcd_and_pem,
                 lambda c: ["--rdzv-endpoints", c.values["https"], "--etcd-timeout", "1",
                            "--lease-ttl", "2", "--etcd-cacert", c.values["ca"], c.script],
                 4, ["TLS", "does not speak TLS"], id="https-to-plain-etcd"),
]

# The unreachable-etcd case must give up well within this bound, not hang.
TIMEOUTS = {"etcd-unreachable": 30}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("setup, make_argv, exit_code, phrases", CASES)
def test_bad_input(request, tmp_path, setup, make_argv, exit_code, phrases):
    case_id = request.node.callspec.id
    with contextlib.ExitStack() as stack:
        ctx = Context(tmp_path, stack, request)
        setup(ctx)
        argv = make_argv(ctx)
        scratch = tmp_path / "tmpdir"  # the agent's scratch folder goes here
        scratch.mkdir()
        env = {**clean_env(), **ctx.values.get("env", {}), "TMPDIR": str(scratch)}
        result = subprocess.run(
            elastic_run(*argv), cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=TIMEOUTS.get(case_id, 60),
        )
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        report = f"argv={argv}\nexit={result.returncode}\nstderr:\n{result.stderr}"
        assert result.returncode == exit_code, report
        assert "Traceback" not in result.stderr, report
        assert lines, report
        last = lines[-1]
        assert last.startswith("elastic-run: error: "), report
        for phrase in phrases:
            assert phrase.format(**ctx.values) in last, report
        assert not [p.name for p in scratch.iterdir() if p.name.startswith("elastic-run")], report
    assert not (tmp_path.parent / "x").exists()  # no run id wrote outside --log-dir


def test_checkpoint_dir_not_writable_names_the_path(request, tmp_path):
    """A worker-side error: the job's one line names the worker, its tail the cause."""
    ctx = Context(tmp_path, contextlib.ExitStack(), request)
    unwritable_checkpoint_dir(ctx)
    result = subprocess.run(
        elastic_run("--max-restarts", "0", str(MLP), "--checkpoint-dir", ctx.values["ckpt"],
                    "--steps", "3"),
        cwd=tmp_path, env=clean_env(), stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=90)
    errors = [line for line in result.stderr.splitlines() if line.startswith("elastic-run")]
    assert result.returncode == 6, result.stderr
    assert "worker global rank 0 (local rank 0)" in result.stderr
    assert "exited with code 1" in result.stderr
    worker_error = [line for line in result.stderr.splitlines()
                    if "elastic-run worker: error:" in line]
    assert worker_error and ctx.values["ckpt"] in worker_error[-1]
    assert "Traceback" not in result.stderr
    assert errors[-1].startswith("elastic-run: error:")


HELP_FLAGS = ["--min-nodes", "--max-nodes", "--nnodes", "--nproc-per-node", "--rdzv-endpoints",
              "--run-id", "--node-id", "--max-restarts", "--lease-ttl", "--join-timeout",
              "--settle", "--master-addr", "--master-port", "--log-dir", "--standalone", "-m"]


def test_help_lists_flags(tmp_path):
    result = subprocess.run(elastic_run("--help"), cwd=tmp_path, env=clean_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    for flag in HELP_FLAGS:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", result.stdout), flag
