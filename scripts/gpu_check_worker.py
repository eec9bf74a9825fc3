"""The training script of scripts/gpu_check.py: what one GPU worker saw, as JSON lines.

Why a failure is injected: on a machine with one GPU the world is one worker, and
NCCL refuses two ranks on one device, so no second node can come or go. Instead,
at `--fail-at` of the first round every rank breaks its group as a broken round
does (worker/broken_round.py): another thread aborts its NCCL communicators
(abort.abort_nccl_communicators), and the next all-reduce must then raise torch's
DistBackendError, which er.elastic classifies as a failed collective (on a CPU run,
with no communicator to abort, a DistError stands for it): the worker leaves its group, reports
PAUSED, its agent opens the next round with the same member, and the worker joins
that round in its own process, in a new process group (a new NCCL communicator).
Before raising, every rank but 0 loses its state as a newcomer holds none (its
parameters shifted, its step unknown), so the new round's State.sync must send rank
0's state to them through the NCCL buckets of worker/state_transfer.py.

Each rank appends to `--out` (one JSON object a line, `kind` says which):
  start   before er.init(): pid, local rank, the monotonic clock
  init    after er.init() and a first all-reduce (on NCCL it creates the communicator,
          which init_process_group leaves for later): their seconds, backend, device
  formed  at each call of the training function, after an all-reduce in that round's
          group: round, rank, world, pid, device, torch.cuda.current_device(), whether
          the group is a new object, the NCCL group's uid, that all-reduce's seconds,
          a checksum of the parameters and what State.sync moved (bytes received,
          from which rank, its seconds)
  failed  the injected failure: round, step, steps trained in the round and their time,
          NCCL groups aborted, and the error the all-reduce after the abort raised
  steps   a call that trained to the end: round, steps and their time
  done    after the training function returned
Every clock value is time.monotonic() of this process: the checker compares values
of one pid only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
import weakref

import torch
import torch.distributed as dist

import elastic_runner as er
from elastic_runner.worker.abort import abort_nccl_communicators

DIM = 256
LOG = logging.getLogger("gpu_check_worker")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="append JSON lines here")
    parser.add_argument("--steps", type=int, default=60, help="global steps to train")
    parser.add_argument("--fail-at", type=int, default=20,
                        help="step of the first round at which every rank fails")
    parser.add_argument("--global-batch", type=int, default=64)
    return parser.parse_args()


class Recorder:
    """One JSON line per event, flushed at once: the agent may stop this process."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)

    def write(self, kind: str, **fields) -> None:
        self._file.write(json.dumps({"kind": kind, "pid": os.getpid(),
                                     "t": time.monotonic(), **fields}) + "\n")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_collective_s(device: torch.device) -> float | None:
    """Seconds of one all-reduce in the current group (on NCCL the first one also
    creates the communicator); None outside a group."""
    if not dist.is_initialized():
        return None
    began = time.monotonic()
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    synchronize(device)
    return time.monotonic() - began


def nccl_uid() -> int | None:
    """ProcessGroupNCCL.uid: a number torch gives each NCCL group object it creates."""
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cuda"))
        return int(backend.uid)
    except (AttributeError, RuntimeError, TypeError):
        return None


def break_group(device: torch.device, step: int) -> tuple[BaseException, dict]:
    """The error this rank's training raises at the injected failure, and how it came.

    On a GPU, the broken round's own way: a second thread aborts the communicators
    while this one waits, then an all-reduce must fail with torch's DistBackendError.
    An all-reduce that succeeds after the abort is reported, and a DistError raised
    instead, so that the check can still re-form and say what it saw."""
    if device.type != "cuda":
        return dist.DistError(f"gpu_check: injected collective failure at step {step}"), {
            "nccl_aborted": None, "raised": None}
    aborted: list[int] = []
    watch = threading.Thread(target=lambda: aborted.append(abort_nccl_communicators(LOG)))
    watch.start()
    watch.join(60)
    how = {"nccl_aborted": aborted[0] if aborted else None}
    try:
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe)
        synchronize(device)
    except Exception as error:  # noqa: BLE001 - what the abort made it raise is the finding
        return error, {**how, "raised": type(error).__name__}
    return dist.DistError("gpu_check: the all-reduce after the abort succeeded"), {
        **how, "raised": None}


def checksum(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


def forget_state(state: er.State) -> None:
    """Make this rank a newcomer: parameters that differ from every other rank's, and
    no known step (State's own marker for that), so the next sync sends it the state."""
    with torch.no_grad():
        for param in state.model.parameters():
            param.add_(1.0)
    state._step = -1  # noqa: SLF001 - what a fresh State holds; no public way to lose it


def record_formation(record: Recorder, device: torch.device, memory: dict,
                     state: er.State) -> None:
    """The `formed` line of this call; `memory["group"]` remembers the group weakly, so
    the next call can tell a new group from the old one without keeping it alive."""
    ctx = er.current()
    sync = state.last_sync  # what State.sync did just before this call
    collective_s = first_collective_s(device)
    group = dist.group.WORLD if dist.is_initialized() else None
    previous = memory["group"]() if memory["group"] is not None else None
    record.write("formed", round=ctx.round, rank=ctx.rank, world=ctx.world_size,
                 local_rank=ctx.local_rank, device=ctx.device,
                 backend=dist.get_backend() if group is not None else None,
                 cuda_device=torch.cuda.current_device() if device.type == "cuda" else None,
                 new_group=None if memory["group"] is None else group is not previous,
                 nccl_uid=nccl_uid() if group is not None else None,
                 collective_s=collective_s, checksum=checksum(state.model),
                 received=sync.received if sync else None,
                 sync_source=sync.source if sync else None,
                 sync_s=sync.seconds if sync else None)
    memory["group"] = weakref.ref(group) if group is not None else None


def build(args: argparse.Namespace, device: torch.device):
    """Data, model and optimizer on the worker's device; the sampler; their State."""
    samples = args.steps * args.global_batch
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(samples, DIM, generator=generator).to(device)
    targets = torch.randn(samples, 1, generator=generator).to(device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh(),
                                torch.nn.Linear(DIM, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = er.ElasticSampler(samples, global_batch_size=args.global_batch, seed=0)
    return (inputs, targets), er.State(model=model, optimizer=optimizer, sampler=sampler)


def main() -> None:
    args = parse_args()
    record = Recorder(args.out)
    record.write("start", local_rank=int(os.environ.get("LOCAL_RANK", 0)))
    began = time.monotonic()
    ctx = er.init()
    init_s = time.monotonic() - began
    device = torch.device(ctx.device)
    record.write("init", init_s=init_s, first_collective_s=first_collective_s(device),
                 backend=ctx.backend, device=ctx.device,
                 cuda_visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
    (inputs, targets), state = build(args, device)
    model, optimizer, sampler = state.model, state.optimizer, state.sampler
    memory = {"group": None, "failed": False}

    @er.elastic(state)
    def train(state):
        record_formation(record, device, memory, state)
        ctx = er.current()
        began, trained = time.monotonic(), 0
        for step, indices in sampler:
            if step == args.fail_at and not memory["failed"]:
                memory["failed"] = True
                synchronize(device)
                if ctx.rank > 0:
                    forget_state(state)
                error, how = break_group(device, step)
                record.write("failed", round=ctx.round, rank=ctx.rank, step=step,
                             steps=trained, steps_s=time.monotonic() - began, **how)
                raise error
            optimizer.zero_grad()
            batch = torch.tensor(indices, dtype=torch.long, device=device)
            torch.nn.functional.mse_loss(model(inputs[batch]), targets[batch]).backward()
            for param in model.parameters():
                dist.all_reduce(param.grad)  # a world of one still runs NCCL
                param.grad /= ctx.world_size
            optimizer.step()
            trained += 1
            if step >= args.steps:
                break
        synchronize(device)
        record.write("steps", round=ctx.round, rank=ctx.rank, steps=trained,
                     steps_s=time.monotonic() - began, last_step=sampler.step)
        return sampler.step

    record.write("done", last_step=train())
    er.finish()


if __name__ == "__main__":
    main()
