"""A tiny character-level language model on a text file the repo ships.

Predicts the next character from the previous `--context` characters with an
embedding and a two-layer MLP. Same elastic pattern as train_mlp.py: exactly-once
sampling of text windows, rank-0 checkpoints, resume after every resize.

    elastic-run --min-nodes 1 --max-nodes 4 examples/train_char_lm.py --epochs 2
"""

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist

import elastic_runner as er

CORPUS = Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"


class CharModel(torch.nn.Module):
    def __init__(self, vocab: int, context: int, width: int = 64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 16)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16 * context, width), torch.nn.Tanh(),
                                       torch.nn.Linear(width, vocab))

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(windows).flatten(1))


def windows_of(text: str, context: int):
    vocab = sorted(set(text))
    codes = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    starts = torch.arange(len(codes) - context)
    inputs = torch.stack([codes[s:s + context] for s in starts.tolist()])
    return vocab, inputs, codes[context:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--text", default=str(CORPUS))
    parser.add_argument("--context", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--checkpoint-dir", default="runs/char-lm-ckpt")
    parser.add_argument("--every", type=int, default=50)
    args = parser.parse_args()

    with er.init() as ctx:
        vocab, inputs, targets = windows_of(Path(args.text).read_text(), args.context)
        torch.manual_seed(0)
        model = CharModel(len(vocab), args.context)
        sampler = er.ElasticSampler(len(inputs), global_batch_size=args.global_batch, seed=1)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        ckpt = er.Checkpointer(args.checkpoint_dir, keep=2, every=args.every)
        state = ckpt.load_latest()
        if state:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optim"])
            sampler.load_state_dict(state["sampler"])
        for epoch in range(sampler.epoch, args.epochs):
            sampler.set_epoch(epoch)
            started = time.perf_counter()
            for step, indices in sampler:
                optimizer.zero_grad()
                batch = torch.tensor(indices, dtype=torch.long)
                logits = model(inputs[batch])
                loss_sum = torch.nn.functional.cross_entropy(logits, targets[batch],
                                                             reduction="sum")
                (loss_sum / sampler.batch_plan.global_batch).backward()
                if ctx.world_size > 1:
                    for param in model.parameters():
                        dist.all_reduce(param.grad)
                optimizer.step()
                if ctx.rank == 0 and step % 20 == 0:
                    rate = sampler.batch_plan.global_batch / (time.perf_counter() - started)
                    print(f"step {step} world {ctx.world_size} loss "
                          f"{loss_sum.item() / max(len(indices), 1):.3f} samples/s {rate:.0f}",
                          flush=True)
                started = time.perf_counter()
                if ckpt.due(step):
                    ckpt.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict(),
                                     "sampler": sampler.state_dict()})
        ckpt.close()


if __name__ == "__main__":
    main()
