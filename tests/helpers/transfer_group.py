"""Ranks of one gloo group that sync an er.State (worker/state_transfer.py).

Run by tests/integration/test_state_transfer.py::

    transfer_group.py SCENARIO OUT PORT

The ranks are forked from this process after `import torch` (importing it costs
seconds of CPU per process). Each builds the same model (a tied weight included)
and Adam optimizer from seed 0; the ranks named "ahead" train `AHEAD_STEPS` steps
first, so they hold optimizer state and a later step, and the others hold none.
Buckets are 1,000 bytes, so the state crosses hundreds of them and tensors span
bucket edges. Each rank writes OUT/rank<N>.json: its step, bytes received, the
SHA-256 of its parameters and optimizer state, and, for `source-dies`, what it saw.

- `three`: rank 0 ahead; ranks 1 and 2 behind.
- `equal`: ranks 0 and 1 ahead, rank 2 behind.
- `source-dies`: rank 0 ahead; it exits after a few buckets, mid-transfer.
- `source-holds`: rank 0 ahead; after a few buckets it stops sending but keeps its
  connections open (a frozen peer); 1 s after it stopped (it says so in a file) the
  receivers cut their groups as the broken-round watch does, and say how long their
  sync took to fail. Counted from the stop, not from the start of the sync: on a
  loaded machine a timer from the start cut the groups before the source held.
- `source-holds-uncut`: the same without the cut, the group's timeout 4 s: the
  transfer's own group must give up with it, not after torch's default 30 minutes.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

AHEAD_STEPS = 3
AHEAD = {"three": {0}, "equal": {0, 1}, "source-dies": {0}, "source-holds": {0},
         "source-holds-uncut": {0}}
TIMEOUT_S = {"source-holds-uncut": 4}
CUT_AFTER_S = 1.0
BUCKETS_BEFORE_DYING = 3
HELD = "source-held"  # the file the holding source creates once it stops sending


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.hidden = torch.nn.Linear(16, 16).to(torch.bfloat16)
        self.out = torch.nn.Linear(16, 50, bias=False)
        self.out.weight = self.embed.weight  # one tensor under two names
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens):
        hidden = self.hidden(self.embed(tokens).to(torch.bfloat16)).float()
        self.seen += tokens.numel()
        return self.out(hidden)


def build():
    import elastic_runner as er

    torch.manual_seed(0)
    model = Tied()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optimizer, er.State(model=model, optimizer=optimizer)


def fingerprint(model, optimizer) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + tensor.float().numpy().tobytes())
    for index, values in sorted(optimizer.state_dict()["state"].items()):
        for key, tensor in sorted(values.items()):
            digest.update(f"{index}{key}".encode() + tensor.float().numpy().tobytes())
    return digest.hexdigest()


def die_mid_transfer() -> None:
    """The source exits after BUCKETS_BEFORE_DYING tensor broadcasts."""
    real, calls = dist.broadcast, [0]

    def broadcast(tensor, *args, **kwargs):
        calls[0] += 1
        if calls[0] > 2 + BUCKETS_BEFORE_DYING:  # 2: the skeleton's size and bytes
            os._exit(0)
        return real(tensor, *args, **kwargs)

    dist.broadcast = broadcast


def hold_mid_transfer(out: str) -> None:
    """The source stops after BUCKETS_BEFORE_DYING tensor broadcasts, its sockets open,
    until both receivers wrote their results."""
    real, calls = dist.broadcast, [0]

    def broadcast(tensor, *args, **kwargs):
        calls[0] += 1
        if calls[0] > 2 + BUCKETS_BEFORE_DYING:
            Path(out, HELD).touch()
            while not all(Path(out, f"rank{rank}.json").exists() for rank in (1, 2)):
                time.sleep(0.05)
            os._exit(0)
        return real(tensor, *args, **kwargs)

    dist.broadcast = broadcast


def cut_later(out: str) -> None:
    """What the broken-round watch does once the agent marks the round broken: here
    CUT_AFTER_S after the source held."""
    from elastic_runner.worker.abort import group_sockets

    def cut() -> None:
        while not Path(out, HELD).exists():
            time.sleep(0.02)
        time.sleep(CUT_AFTER_S)
        group_sockets.cut()

    threading.Thread(target=cut, daemon=True).start()


def rank_main(rank: int, scenario: str, out: str, port: int) -> None:
    from elastic_runner.worker import state_transfer
    from elastic_runner.worker.elastic import collective_failure

    from elastic_runner.worker.abort import capturing_sockets

    state_transfer.BUCKET_BYTES = 1000
    with capturing_sockets("gloo"):  # as er.init() forms a round's group
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=3, timeout=datetime.timedelta(
                                    seconds=TIMEOUT_S.get(scenario, 30)))
    model, optimizer, state = build()
    if rank in AHEAD[scenario]:
        for step in range(1, AHEAD_STEPS + 1):
            optimizer.zero_grad()
            model(torch.arange(8) % 50).sum().backward()
            optimizer.step()
            state.commit(step)
    before = fingerprint(model, optimizer)
    if scenario == "source-dies" and rank == 0:
        die_mid_transfer()
    if scenario.startswith("source-holds"):
        if rank == 0:
            hold_mid_transfer(out)
        elif scenario == "source-holds":
            cut_later(out)
    result = {"rank": rank, "before": before, "tensor_bytes": sum(
        t.numel() * t.element_size() for t in state_transfer.split(state._states())[1])}
    started = time.monotonic()
    try:
        result["received"] = state.sync()
    except RuntimeError as error:
        result["error"] = str(error).splitlines()[0]
        result["collective_failure"] = collective_failure(error) is not None
    result["sync_s"] = time.monotonic() - started
    result.update(step=state.step, after=fingerprint(model, optimizer),
                  tied=model.out.weight.data_ptr() == model.embed.weight.data_ptr(),
                  seen=int(model.seen), adam_states=len(optimizer.state))
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # no destroy: a peer may be gone


def main() -> None:
    scenario, out, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    context = mp.get_context("fork")
    ranks = [context.Process(target=rank_main, args=(rank, scenario, out, port))
             for rank in range(3)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(120)


if __name__ == "__main__":
    main()
