"""Network partition: one node cut off from etcd and its peers by a veth link going
down in a network namespace this test creates (root only)."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

from elastic_runner.etcd.server import EmbeddedEtcd
from tests.e2e.harness import Job
from tests.faults import at_step, partition, run_schedule

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                       reason="needs root (CAP_NET_ADMIN) and iproute2 to create network "
                              "namespaces and veth pairs"),
]

HOST_IP, NS_IP = "10.231.77.1", "10.231.77.2"


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespace():
    """A namespace `ns` linked to the root namespace by a veth pair on a /30."""
    tag = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"er-{tag}", f"erh{tag}", f"ern{tag}"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", ns)
        sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{NS_IP}/30", "dev", ns_if)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, host_if, ns_if
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_partitioned_node_is_dropped_stops_its_workers_and_rejoins(namespace, tmp_path):
    ns, host_if, ns_if = namespace
    with EmbeddedEtcd(host=HOST_IP) as etcd:
        job = Job(etcd.endpoint, tmp_path, nproc=1, lease_ttl=2)
        try:
            job.env = {"GLOO_SOCKET_IFNAME": host_if}
            job.start("a", "b", master_addr=HOST_IP)
            job.wrap["c"] = ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={ns_if}"]
            job.start("c", master_addr=NS_IP)
            job.wait_world(3, timeout=60)
            fired = run_schedule(job, [at_step(max(r["step"] for r in job.steps()) + 5,
                                               partition(ns, ns_if, 15.0))])
            cut_at = fired[0].time
            rows = job.wait_world(2, after=cut_at, timeout=40)
            assert {int(r["RANK"]) for r in rows} == {0, 1}
            # The cut-off node noticed on its own and stopped its workers.
            job.wait_for(lambda: "workers stopped, waiting up to" in job.agent_log("c") or None,
                         30, "c to stop its workers")
            assert job.agents["c"].poll() is None
            # Healed after 15 s: it re-registers and the job grows back to 3.
            rows = job.wait_world(3, after=cut_at + 15, timeout=60)
            assert {int(r["RANK"]) for r in rows} == {0, 1, 2}
        finally:
            job.stop_all()
