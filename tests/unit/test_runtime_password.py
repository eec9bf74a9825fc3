"""Workers take the etcd password from the agent's 0600 file, never from a variable."""

from __future__ import annotations

import logging

from elastic_runner.worker import runtime


def test_password_comes_from_the_file_not_the_environment(tmp_path):
    secret = tmp_path / "etcd-password"
    secret.write_text("s3cret pass\n")
    secret.chmod(0o600)
    ctx = runtime.context_from_env({"ELASTIC_RUN_ETCD_PASSWORD_FILE": str(secret),
                                    "ELASTIC_RUN_ETCD_PASSWORD": "from-env",
                                    "ELASTIC_RUN_ETCD_USER": "alice"}, "gloo", "cpu")
    assert ctx.etcd_options == {"user": "alice", "password": "s3cret pass"}
    assert "s3cret" not in repr(ctx)
    alone = runtime.context_from_env({"ELASTIC_RUN_ETCD_PASSWORD": "from-env"}, "gloo", "cpu")
    assert "password" not in alone.etcd_options


def test_an_unreadable_password_file_leaves_the_password_out(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="elastic_runner.worker.runtime")
    missing = tmp_path / "gone"
    ctx = runtime.context_from_env({"ELASTIC_RUN_ETCD_PASSWORD_FILE": str(missing),
                                    "ELASTIC_RUN_ETCD_USER": "alice"}, "gloo", "cpu")
    assert ctx.etcd_options == {"user": "alice"}
    (warning,) = [r for r in caplog.records if r.name == "elastic_runner.worker.runtime"]
    assert str(missing) in warning.getMessage()
