"""er.finish() frees the process group, however late the script imports torch._dynamo.

Found in a suite run: a restart-path worker exited with SIGABRT ("terminate called
without an active exception") just after its last step, and its agent restarted the
round, redoing 111 steps. Its gloo threads were still running at the interpreter's
finalization: torch.distributed.nn's functions hold `group.WORLD` as a default
argument bound at import, and the first optimizer imports it (through torch._dynamo)
after er.init() formed the group, so destroy_process_group() freed nothing. Real
processes, a real gloo group of two ranks; each reports the threads it still has
after er.finish()."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from elastic_runner.contract import WorkerEnv
from elastic_runner.etcd.server import free_port

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    import elastic_runner as er

    er.init()
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # imports torch._dynamo
    sampler = er.ElasticSampler(64, global_batch_size=8)
    for step, indices in sampler:  # the step boundary's own group agrees at each step
        optimizer.zero_grad()
        model(torch.ones(len(indices), 4)).sum().backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
        optimizer.step()
    er.finish()
    threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip()
                     for t in os.listdir("/proc/self/task"))
    json.dump({"threads": threads, "dynamo": "torch._dynamo" in sys.modules},
              open(sys.argv[1], "w"))
""")


def test_er_finish_leaves_no_gloo_thread_and_no_store_server_running(tmp_path):
    port = free_port()
    (tmp_path / "reform").mkdir()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("ELASTIC_RUN_", "TORCHELASTIC_"))}
    workers = []
    for rank in (0, 1):
        env = {**base, **WorkerEnv(rank=rank, world_size=2, master_addr="127.0.0.1",
                                   master_port=port, round=0,
                                   reform_dir=str(tmp_path / "reform"),
                                   collective_timeout_s=60).to_env()}
        workers.append(subprocess.Popen(
            [sys.executable, "-c", WORKER, str(tmp_path / f"rank{rank}.json")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [worker.communicate(timeout=120)[0] for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    assert [worker.returncode for worker in workers] == [0, 0], outputs
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["dynamo"]
        # Before: two pt_gloo_runloop threads per group still running, a gloo_tcp_loop,
        # and on rank 0 the store's pt_tcpstore_uv server.
        left = [t for t in report["threads"] if t.startswith(("pt_gloo", "gloo", "pt_tcpstore"))]
        assert left == [], (rank, report["threads"])
