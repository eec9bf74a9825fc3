"""TLS with client certificates, password auth with a role limited to the run,
token expiry, and secrets kept out of logs and etcd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_runner.config import EtcdConfig
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.etcd.server import EmbeddedEtcd
from tests.helpers.certs import make_pki

PROBE = Path(__file__).resolve().parents[1] / "helpers" / "probe_worker.py"
PASSWORD = "s3cret-Pa55word"


def elastic_run(*flags: str, out: Path, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastic_runner", "--min-nodes", "1", "--max-nodes", "1",
         "--settle", "0.2", "--lease-ttl", "2", *flags, str(PROBE), "--out", str(out),
         "--steps", "40", "--step-time", "0.1"],
        capture_output=True, text=True, timeout=timeout)


def etcdctl(server: EmbeddedEtcd, *args: str, user: str | None = None) -> None:
    binary = Path(server.binary).with_name("etcdctl")
    auth = ["--user", user] if user else []
    subprocess.run([str(binary), "--endpoints", server.endpoint, *auth, *args],
                   check=True, capture_output=True, env={"ETCDCTL_API": "3"}, timeout=30)


def last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


@pytest.fixture
def pki(tmp_path):
    return make_pki(tmp_path / "pki"), make_pki(tmp_path / "other", name="other")


def test_tls_with_client_certificates(pki, tmp_path):
    good, other = pki
    with EmbeddedEtcd(tls_files=good) as server:
        flags = ["--rdzv-endpoints", server.endpoint, "--etcd-cacert", str(good["ca"]),
                 "--etcd-cert", str(good["client_cert"]), "--etcd-key", str(good["client_key"])]
        done = elastic_run(*flags, "--run-id", "tls", out=tmp_path / "ok.jsonl")
        assert done.returncode == 0, done.stderr[-2000:]
        assert len((tmp_path / "ok.jsonl").read_text().splitlines()) == 40

        wrong = ["--rdzv-endpoints", server.endpoint, "--etcd-cacert", str(other["ca"]),
                 "--etcd-cert", str(other["client_cert"]), "--etcd-key",
                 str(other["client_key"]), "--etcd-timeout", "1"]
        refused = elastic_run(*wrong, "--run-id", "tls2", out=tmp_path / "no.jsonl")
        assert refused.returncode == 4
        assert "Traceback" not in refused.stderr
        assert server.endpoint in last_line(refused.stderr)


@pytest.fixture
def auth_etcd():
    # Tokens live 2 s here, so a 4 s run proves the client logs in again.
    with EmbeddedEtcd(extra_args=("--auth-token-ttl", "2")) as server:
        etcdctl(server, "user", "add", "root:rootpw")
        etcdctl(server, "role", "add", "trainer")
        etcdctl(server, "role", "grant-permission", "trainer", "--prefix=true", "readwrite",
                "/elastic-runner/v2/authjob/")
        etcdctl(server, "user", "add", f"alice:{PASSWORD}")
        etcdctl(server, "user", "grant-role", "alice", "trainer")
        etcdctl(server, "auth", "enable", user="root:rootpw")
        yield server


def test_password_auth_limited_to_the_run_and_no_secret_leaks(auth_etcd, tmp_path):
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    done = elastic_run("--rdzv-endpoints", auth_etcd.endpoint, "--run-id", "authjob",
                       "--etcd-user", "alice", "--etcd-password-file", str(password_file),
                       "-v", out=tmp_path / "ok.jsonl")
    assert done.returncode == 0, done.stderr[-3000:]
    assert len((tmp_path / "ok.jsonl").read_text().splitlines()) == 40
    assert PASSWORD not in done.stdout + done.stderr
    root = EtcdClient(EtcdConfig((auth_etcd.endpoint,), 2.0, 5.0, user="root",
                                 password="rootpw"))
    entries, _ = root.get_prefix("/")
    root.close()
    assert entries and not [kv.key for kv in entries if PASSWORD.encode() in kv.value]

    outside = elastic_run("--rdzv-endpoints", auth_etcd.endpoint, "--run-id", "otherjob",
                          "--etcd-user", "alice", "--etcd-password-file", str(password_file),
                          out=tmp_path / "outside.jsonl")
    assert outside.returncode == 4 and "refused" in last_line(outside.stderr)

    password_file.write_text("wrong\n")
    wrong = elastic_run("--rdzv-endpoints", auth_etcd.endpoint, "--run-id", "authjob",
                        "--etcd-user", "alice", "--etcd-password-file", str(password_file),
                        out=tmp_path / "no.jsonl")
    assert wrong.returncode == 4
    assert "Traceback" not in wrong.stderr and "--etcd-user" in last_line(wrong.stderr)


ENV_PROBE = """
import json, os, stat, sys
path = os.environ.get("ELASTIC_RUN_ETCD_PASSWORD_FILE", "")
info = {"leaks": [k for k, v in os.environ.items() if sys.argv[2] in v],
        "path": path, "mode": None, "content": None}
if path:
    info["mode"] = stat.S_IMODE(os.stat(path).st_mode)
    info["content"] = open(path).read()
import elastic_runner as er
ctx = er.init()
info["has_password"] = ctx.etcd_options.get("password") == sys.argv[2]
er.finish()
open(sys.argv[1], "w").write(json.dumps(info))
"""


def test_workers_get_the_password_in_a_private_file_not_their_environment(auth_etcd, tmp_path):
    """The agent takes the password from its environment; its workers must not inherit it
    (/proc/PID/environ, crash reports): they read a 0600 file that goes with the round."""
    script = tmp_path / "env_probe.py"
    script.write_text(ENV_PROBE)
    out = tmp_path / "seen.json"
    env = {**os.environ, "ELASTIC_RUN_ETCD_PASSWORD": PASSWORD}
    done = subprocess.run(
        [sys.executable, "-m", "elastic_runner", "--rdzv-endpoints", auth_etcd.endpoint,
         "--run-id", "authjob", "--etcd-user", "alice", "--settle", "0.2", str(script),
         str(out), PASSWORD], capture_output=True, text=True, timeout=90, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen["leaks"] == []
    assert seen["mode"] == 0o600 and seen["content"] == PASSWORD
    assert seen["has_password"] is True
    assert not Path(seen["path"]).exists()
