"""How a rank that is behind gets the state: er.State.sync vs torch's ways, side by side.

Two gloo ranks, forked after `import torch`, build the same MLP and Adam optimizer;
rank 0 trains one step (so it holds Adam's two moments and a later step), rank 1 is
a newcomer that holds none. Then, for each way, rank 1 ends up with rank 0's model
and optimizer state, checked by a checksum of the parameters:

- `er.State.sync` (worker/state_transfer.py): the tensors' raw bytes in 64 MiB
  buckets, the rest pickled;
- `torch broadcast_object_list`: torch.distributed's own way to send a Python object
  to peers (pickles the state dicts with torch's pickler, broadcasts the bytes);
  State.sync sent one torch.save blob this way until 2026-12-04;
- `checkpoint file`: what the restart path does (elastic-run's, torchrun's): rank 0
  torch.saves the state to local disk (fsync, not timed), rank 1 torch.loads it and
  loads the state dicts (timed); a local disk, the best case for a checkpoint.

Reported per state size: rank 1's seconds (median of --repeats, each way in a fresh
pair of processes), MB/s, and how much rank 1's peak RSS grew (host memory the way
needs on top of the model). Ratios: er / the others.

    .venv/bin/python bench/state_transfer.py                 # 10, 100, 400 MB, ~1 min
    .venv/bin/python bench/state_transfer.py --sizes 1000 --repeats 1
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common as c  # noqa: E402

WAYS = {"er": "er.State.sync", "object": "torch broadcast_object_list",
        "file": "checkpoint file (local disk)"}
WIDTH = 1024


def layers_for(mb: float) -> int:
    """Linear layers whose weights and two Adam moments come to about `mb` MB."""
    return max(1, round(mb * 2**20 / 12 / (WIDTH * WIDTH)))


def build(mb: float):
    import torch

    import elastic_runner as er

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers_for(mb))])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optimizer, er.State(model=model, optimizer=optimizer)


def train_one_step(model, optimizer, state) -> None:
    import torch

    model(torch.randn(2, WIDTH)).sum().backward()
    optimizer.step()
    state.commit(1)


def move(way: str, rank: int, model, optimizer, state, folder: Path) -> int:
    """Rank 1 gets rank 0's state the given way; the bytes it received."""
    import torch
    import torch.distributed as dist

    if way == "er":
        return state.sync()
    if way == "object":
        box = [{"model": model.state_dict(), "optimizer": optimizer.state_dict()}
               if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if rank == 1:
            model.load_state_dict(box[0]["model"])
            optimizer.load_state_dict(box[0]["optimizer"])
        return 0
    path = folder / "ckpt.pt"
    if rank == 1:
        data = torch.load(path, map_location="cpu", weights_only=False)
        model.load_state_dict(data["model"])
        optimizer.load_state_dict(data["optimizer"])
        return path.stat().st_size
    return 0


def save_file(model, optimizer, folder: Path) -> None:
    import torch

    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    with open(folder / "ckpt.pt", "wb") as handle:
        handle.write(buffer.getbuffer())
        handle.flush()
        os.fsync(handle.fileno())


def rank_main(rank: int, way: str, mb: float, port: int, folder: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=300))
    model, optimizer, state = build(mb)
    if rank == 0:
        train_one_step(model, optimizer, state)
        if way == "file":
            save_file(model, optimizer, Path(folder))
    dist.barrier()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    received = move(way, rank, model, optimizer, state, Path(folder))
    seconds = time.perf_counter() - started
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    with torch.no_grad():
        checksum = float(sum(p.double().sum() for p in model.parameters()))
    dist.barrier()
    Path(folder, f"rank{rank}.json").write_text(json.dumps({
        "seconds": seconds, "received": received, "rss_growth_mb": grown,
        "checksum": checksum, "adam_states": len(optimizer.state)}))
    dist.destroy_process_group()


def one(way: str, mb: float) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="state-transfer-") as folder:
        port = c.free_port()
        context = mp.get_context("fork")
        ranks = [context.Process(target=rank_main, args=(r, way, mb, port, folder))
                 for r in range(2)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(600)
        source, receiver = (json.loads(Path(folder, f"rank{r}.json").read_text()) for r in (0, 1))
    if source["checksum"] != receiver["checksum"] or receiver["adam_states"] != \
            source["adam_states"]:
        raise SystemExit(f"{way} at {mb} MB: rank 1 does not hold rank 0's state")
    return receiver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,400", help="state sizes, MB (comma list)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch  # noqa: F401 - imported once, before the ranks are forked
    del torch

    sizes = [float(s) for s in args.sizes.split(",")]
    results: dict[str, dict] = {}
    for mb in sizes:
        runs: dict[str, list[dict]] = {way: [] for way in WAYS}
        for _ in range(args.repeats):
            for way in WAYS:  # alternated: background load spreads over all three
                runs[way].append(one(way, mb))
        results[str(mb)] = {way: {
            "seconds": statistics.median(r["seconds"] for r in rows),
            "seconds_all": [r["seconds"] for r in rows],
            "rss_growth_mb": statistics.median(r["rss_growth_mb"] for r in rows),
            "state_mb": build_size_mb(mb)} for way, rows in runs.items()}
    text = render(results, args)
    print(text)
    saved = c.save("state_transfer", {"args": vars(args), "env": c.env_info(),
                                      "results": results}, text)
    print(f"\nwritten: {saved}")


def build_size_mb(mb: float) -> float:
    return layers_for(mb) * (WIDTH * WIDTH + WIDTH) * 4 * 3 / 2**20


def render(results: dict, args) -> str:
    env = c.env_info()
    head = (f"state_transfer: 2 gloo ranks on loopback, MLP {WIDTH}x{WIDTH} layers + Adam, "
            f"rank 1 a newcomer; median of {args.repeats}; RSS = growth of rank 1's peak\n"
            f"{env['date_utc']} UTC, {env['cores']} cores, torch {env['torch']}\n")
    rows = []
    for mb, ways in results.items():
        er_s = ways["er"]["seconds"]
        size = ways["er"]["state_mb"]
        row = [f"{size:.0f} MB"]
        for way in WAYS:
            w = ways[way]
            row.append(f"{w['seconds']:.3f}s ({size / w['seconds']:.0f} MB/s), "
                       f"RSS +{w['rss_growth_mb']:.0f} MB")
        row += [f"{er_s / ways['object']['seconds']:.2f}", f"{er_s / ways['file']['seconds']:.2f}"]
        rows.append(row)
    return head + c.table(["state", *WAYS.values(), "er/object", "er/file"], rows)


if __name__ == "__main__":
    main()
