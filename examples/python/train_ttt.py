"""A character-level language model with TTT-Linear layers, trained in PyTorch with membound's
layers as torch ops (membound.nn), after membound's planner has said what a step will take.

    python3 examples/python/train_ttt.py [--steps 40] [--budget 64MiB] [--data PATH]

Each block is x + TTTLinear(LayerNorm(x)) then x + MLP(LayerNorm(x)), as ttt-lm-pytorch's Block
(without its convolutions); the TTT layers run membound's forward and hand-written backward
(CPU). Before step 1 it prints membound.fit's plan for the same shape of model on membound's own
C++ trainer (which plans the whole step; PyTorch's autograd keeps its own tensors, so the plan is
the C++ trainer's bytes, not this loop's), then trains and prints the loss every 10 steps.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import torch
from torch import nn

import membound
import membound.nn as mnn

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "tinyshakespeare.txt"


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.seq_norm, self.ffn_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.seq_modeling_block = mnn.TTTLinear(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.seq_modeling_block(self.seq_norm(x))
        return x + self.mlp(self.ffn_norm(x))


class CharModel(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--budget", default="64MiB")
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    text = pathlib.Path(args.data).read_bytes()
    data = torch.tensor(list(text), dtype=torch.long)
    plan = membound.fit(membound.Model(layers=["ttt_linear"] * args.blocks, width=args.width, heads=args.heads,
                                       vocab=256),
                        batch=args.batch, seq=args.seq, budget=args.budget, threads=torch.get_num_threads())
    print(f"membound's plan for this model on its C++ trainer, budget {args.budget}:")
    print(plan)

    torch.manual_seed(0)
    model = CharModel(256, args.width, args.heads, args.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)
    start, first = time.perf_counter(), None
    for step in range(1, args.steps + 1):
        at = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        rows = torch.stack([data[i:i + args.seq + 1] for i in at.tolist()])
        logits = model(rows[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256), rows[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        if step % 10 == 0 or step == args.steps:
            tokens = step * args.batch * args.seq
            print(f"step {step:4d}  loss {loss.item():.4f}  {tokens / (time.perf_counter() - start):,.0f} tokens/s")
    print(f"loss {first:.4f} -> {loss.item():.4f} over {args.steps} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
