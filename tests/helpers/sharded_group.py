"""One sharded-checkpoint job: six forked ranks form world 4, then 2, 3 and 6.

Run by tests/integration/test_sharded_checkpoint.py::

    sharded_group.py ROOT OUT ETCD_ENDPOINT PORT_A PORT_B PORT_C PORT_D

Why one process tree: importing torch costs seconds of CPU per process; the ranks are
forked from this process after that import (before any torch op or thread), and each
phase re-forms the default process group at its world size with the first N of them.
FSDP2 (`fully_shard`) on CPU/gloo; the checkpoint is `er.Checkpointer(sharded=True)`.

- A, world 4 (round 0): train steps 1-6, async saves at 3 and 6; rank 0 keeps the
  full model/optimizer state of each saved step (the reference). Then round 1 closes
  (its plan is written) and this round's save of step 9 must be refused on every rank.
- B, C, D, worlds 2, 3, 6 (round 1): restore (step 6, resharded); rank 0 compares the
  full state with the reference. B trains the rest of the epoch (exactly-once check).
  D then flips a byte of one shard of step 6 and restores again: step 3 it must be.
Rank 0 of each phase writes OUT/<phase>.json.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

PREFIX = "/elastic-runner/v2/sharded/"
SAMPLES, GLOBAL_BATCH = 96, 8
PHASES = (("A", 4), ("B", 2), ("C", 3), ("D", 6))


def build():
    from torch.distributed.fsdp import fully_shard

    import elastic_runner as er

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    sampler = er.ElasticSampler(SAMPLES, global_batch_size=GLOBAL_BATCH, seed=1)
    return {"model": model, "optim": optim, "sampler": sampler}


def data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 4, generator=g)


def train_step(objects, indices) -> None:
    x, y = data()
    loss = torch.nn.functional.mse_loss(objects["model"](x[indices]), y[indices])
    loss.backward()
    objects["optim"].step()
    objects["optim"].zero_grad()


def full_state(objects) -> dict:
    """The whole model and optimizer state on rank 0 (all ranks take part)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model, optim = objects["model"], objects["optim"]
    return {"model": get_model_state_dict(model, options=options),
            "optim": get_optimizer_state_dict(model, optim, options=options)}


def max_diff(got, want) -> float:
    """Largest absolute difference of all tensors; inf when the structures differ."""
    if isinstance(want, torch.Tensor):
        return (got.float() - want.float()).abs().max().item() if got.shape == want.shape \
            else float("inf")
    if isinstance(want, dict):
        if set(got) != set(want):
            return float("inf")
        return max([max_diff(got[k], want[k]) for k in want] or [0.0])
    if isinstance(want, (list, tuple)):
        return max([max_diff(a, b) for a, b in zip(got, want)] or [0.0])
    return 0.0 if got == want else float("inf")


def store(endpoint: str, round_number: int):
    from elastic_runner.worker.checkpoint.etcd_store import EtcdLatestStore

    return EtcdLatestStore((endpoint,), PREFIX, round_number)


def gathered(value) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def phase_a(root, out, endpoint, rank) -> dict:
    import elastic_runner as er

    objects = build()
    ckpt = er.Checkpointer(root, sharded=True, keep=3, async_save=True,
                           latest_store=store(endpoint, 0))
    result = {"restored": ckpt.restore(objects), "blocked_s": [], "stale": None}
    consumed = []
    for step, indices in objects["sampler"]:
        train_step(objects, indices)
        if step <= 6:
            consumed += indices
        if step in (3, 6):
            reference = full_state(objects)
            if rank == 0:
                torch.save(reference, out / f"ref-{step}.pt")
                result[f"sampler-{step}"] = objects["sampler"].state_dict()
            started = time.monotonic()
            ckpt.save(step, objects)
            result["blocked_s"].append(round(time.monotonic() - started, 3))
        if step == 6:
            ckpt.wait()
            close_round(endpoint, rank, 1)
        if step == 9:
            result["stale"] = stale_save(ckpt, step, objects)
            break
    ckpt.close()
    result["consumed"] = sorted(i for part in gathered(consumed) for i in part)
    result["stale_all"] = gathered(result["stale"])
    result["record"] = store(endpoint, 1).read()
    return result


def close_round(endpoint, rank, next_round) -> None:
    """The job re-formed without this round: the next round's plan exists."""
    if rank == 0:
        from elastic_runner.config import EtcdConfig
        from elastic_runner.etcd.client import EtcdClient

        client = EtcdClient(EtcdConfig((endpoint,), 2.0, 5.0))
        client.put(f"{PREFIX}rounds/{next_round}/plan", b"{}")
        client.close()
    dist.barrier()


def stale_save(ckpt, step, objects) -> str:
    from elastic_runner.errors import StaleWriterError

    try:
        ckpt.save(step, objects)
        ckpt.wait()
    except StaleWriterError as error:
        return f"refused: {type(error).__name__}"
    return "published"


def restore_phase(root, out, endpoint, rank, name) -> dict:
    import elastic_runner as er

    objects = build()
    if name == "B":  # what a restore that loaded nothing would compare as
        fresh = compare(objects, out, rank, {}, 6, key="fresh")
    ckpt = er.Checkpointer(root, sharded=True, keep=3, latest_store=store(endpoint, 1))
    started = time.monotonic()
    result = {"restored": ckpt.restore(objects), "restore_s": time.monotonic() - started}
    if name == "B":
        result["fresh"] = fresh
    compare(objects, out, rank, result, 6)
    if name == "B":
        consumed = []
        for _step, indices in objects["sampler"]:
            train_step(objects, indices)
            consumed += indices
        result["consumed"] = sorted(i for part in gathered(consumed) for i in part)
    if name == "D":
        if rank == 0:
            flip_a_byte(Path(root) / "step-00000006" / "__2_0.distcp")
        dist.barrier()
        again = build()
        result["after_corruption"] = ckpt.restore(again)
        compare(again, out, rank, result, 3, key="diff_after_corruption")
        result["record"] = store(endpoint, 1).read()
    ckpt.close()
    return result


def compare(objects, out, rank, result, step, key="diff"):
    got = full_state(objects)
    if rank == 0:
        want = torch.load(out / f"ref-{step}.pt", weights_only=False)
        result[key] = {part: max_diff(got[part], want[part]) for part in ("model", "optim")}
        result[f"{key}_sampler"] = objects["sampler"].state_dict()
        return result[key]
    return None


def flip_a_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def rank_main(index: int, root: str, out: str, endpoint: str, ports: list[int]) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[proc{index}] %(levelname)s %(name)s: %(message)s")
    out_dir = Path(out)
    for (name, world), port in zip(PHASES, ports):
        if index >= world:
            continue
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index,
                                world_size=world, timeout=datetime.timedelta(seconds=300))
        if name == "A":
            result = phase_a(root, out_dir, endpoint, index)
        else:
            result = restore_phase(root, out_dir, endpoint, index, name)
        if index == 0:
            (out_dir / f"{name}.json").write_text(json.dumps(result, default=str))
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    root, out, endpoint = sys.argv[1:4]
    ports = [int(p) for p in sys.argv[4:8]]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(rank_main, args=(root, out, endpoint, ports), nprocs=6,
                       start_method="fork")


if __name__ == "__main__":
    main()
