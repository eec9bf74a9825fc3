"""What the agent's counters count: a re-formation in place restarts no worker."""

from __future__ import annotations

from elastic_runner.agent.metrics import MetricsServer


def test_an_in_process_round_counts_as_a_reformation_not_a_restart(tmp_path):
    server = MetricsServer(0, tmp_path, host="127.0.0.1")
    try:
        server.observe({"kind": "round_closed", "world_size": 3, "cause": "start"})
        server.observe({"kind": "round_closed", "world_size": 2, "cause": "member-lost: c",
                        "inprocess": True})
        server.observe({"kind": "round_closed", "world_size": 3, "cause": "newcomer"})
        server.observe({"kind": "round_closed", "world_size": 2, "inprocess": True,
                        "cause": "member-suspected: rank 1 saw a collective fail"})
        value = server.registry.get_sample_value
        assert value("elastic_run_rounds_total") == 4
        assert value("elastic_run_world_size") == 2
        reformed = {c: value("elastic_run_reformations_total", {"cause": c})
                    for c in ("member-lost", "newcomer")}
        restarted = {c: value("elastic_run_restarts_total", {"cause": c})
                     for c in ("member-lost", "newcomer")}
        assert reformed == {"member-lost": 2.0, "newcomer": None}
        assert restarted == {"member-lost": None, "newcomer": 1.0}
    finally:
        server.stop()
