"""The job spec check's fallback for a role limited to the run (no I/O: a fake client).

A role that may not read the older schemas' prefixes gets its one-transaction check
refused as a whole; it must then check what it may, step by step, as before."""

from __future__ import annotations

import pytest

from elastic_runner.config import RendezvousConfig
from elastic_runner.errors import EtcdAuthError, SpecMismatch
from elastic_runner.etcd.client import KeyValue, Read, TxnResult
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous import registration


class LimitedRole:
    """Refuses anything outside the run's own prefix, as etcd does for such a role."""

    def __init__(self, spec_there: bytes | None = None):
        self.spec_there, self.calls = spec_there, []

    def txn(self, compares, success, failure=()):
        self.calls.append("txn")
        raise EtcdAuthError("etcdserver: permission denied")

    def count_prefix(self, prefix):
        self.calls.append(f"count {prefix}")
        raise EtcdAuthError("etcdserver: permission denied")

    def create_if_absent(self, key, value, lease=None):
        self.calls.append(f"create {key}")
        return self.spec_there is None

    def get(self, key):
        self.calls.append(f"get {key}")
        return KeyValue(key, self.spec_there, 1, 1, 1, 0)


CONFIG = RendezvousConfig(run_id="job", node_id="a", min_nodes=1, max_nodes=2)
SPEC = p.JobSpec(1, 2, "script-a")


def test_a_role_limited_to_the_run_checks_step_by_step_and_creates_the_spec():
    client = LimitedRole()
    registration.check_spec(client, CONFIG, SPEC)
    spec_key = p.spec_key(CONFIG.prefix)
    assert client.calls == ["txn", "count /elastic-runner/v0/job/",
                            "count /elastic-runner/v1/job/", f"create {spec_key}"]


def test_a_role_limited_to_the_run_still_sees_a_different_job():
    client = LimitedRole(spec_there=p.JobSpec(1, 4, "script-a").to_json())
    with pytest.raises(SpecMismatch, match="max_nodes 4"):
        registration.check_spec(client, CONFIG, SPEC)


class RunOnlyRole(LimitedRole):
    """Allows transactions on the run's own keys only, as etcd does for such a role."""

    def txn(self, compares, success, failure=()):
        keys = [c.key for c in compares] + [op.key for op in success]
        if any(not key.startswith(CONFIG.prefix) for key in keys):
            self.calls.append("txn refused")
            raise EtcdAuthError("etcdserver: permission denied")
        self.calls.append(f"txn {compares[0].key}")
        return TxnResult(True, 7)


def test_registration_of_a_role_limited_to_the_run_checks_the_spec_step_by_step():
    """The one-transaction registration compares the older schemas' prefixes; refused,
    the agent checks the spec as check_spec does, then creates its node key."""
    client = RunOnlyRole()
    result = registration.register_node(client, CONFIG, SPEC, b"record", 5)
    assert result.succeeded
    assert client.calls == ["txn refused", "txn refused", "count /elastic-runner/v0/job/",
                            "count /elastic-runner/v1/job/", f"create {p.spec_key(CONFIG.prefix)}",
                            f"txn {p.node_key(CONFIG.prefix, 'a')}"]


def test_registration_of_another_job_writes_no_node_key():
    client = RunOnlyRole(spec_there=p.JobSpec(1, 4, "script-a").to_json())
    with pytest.raises(SpecMismatch, match="max_nodes 4"):
        registration.register_node(client, CONFIG, SPEC, b"record", 5)
    assert not [call for call in client.calls if "/nodes/" in call]


class MarkedRunRole(RunOnlyRole):
    """A role limited to the run, on a run marked as re-forming in place (open round
    0) whose spec is `spec_there`: answers a plain read of the run's keys."""

    def txn(self, compares, success, failure=()):
        if compares:
            return super().txn(compares, success, failure)
        self.calls.append("read")
        stored = {p.spec_key(CONFIG.prefix): self.spec_there,
                  p.inplace_key(CONFIG.prefix): b'{"round": 0}',
                  p.round_key(CONFIG.prefix): p.first_round().to_json()}
        return TxnResult(True, 7, tuple(
            Read(1, (KeyValue(op.key, stored[op.key], 1, 1, 1, 0),)) for op in success))


def test_a_role_limited_to_the_run_stands_by_in_a_run_that_re_forms_in_place():
    """Its registration transaction refused, it reads the spec, the mark and the round
    as the refused transaction would have: our spec and a mark, so nothing is written."""
    client = MarkedRunRole(spec_there=SPEC.to_json())
    answer = registration.register_node(client, CONFIG, SPEC, b"record", 5,
                                        unless_in_place=True)
    assert answer is registration.STAND_BY
    assert client.calls == ["txn refused", "read"]


def test_a_role_limited_to_the_run_does_not_stand_by_for_another_job():
    """Another job's spec under our run id is refused before any standby worker starts,
    whether the registration transaction was refused or answered."""
    client = MarkedRunRole(spec_there=p.JobSpec(1, 4, "script-a").to_json())
    with pytest.raises(SpecMismatch, match="max_nodes 4"):
        registration.register_node(client, CONFIG, SPEC, b"record", 5, unless_in_place=True)
    assert not [call for call in client.calls if "/nodes/" in call]
