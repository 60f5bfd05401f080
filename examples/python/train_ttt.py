"""A character-level language model with TTT-Linear layers, trained in PyTorch with membound's
layers as torch ops (membound.nn), after membound's planner has said what a step will take.

    python3 examples/python/train_ttt.py [--steps 40] [--budget 64MiB] [--data PATH]
    python3 examples/python/train_ttt.py --pack 16        # the corpus's paragraphs, packed, no padding

Each block is x + TTTLinear(LayerNorm(x)) then x + MLP(LayerNorm(x)), as ttt-lm-pytorch's Block
(without its convolutions); the TTT layers run membound's forward and hand-written backward
(CPU). Before step 1 it prints membound.fit's plan for the same shape of model on membound's own
C++ trainer (which plans the whole step; PyTorch's autograd keeps its own tensors, so the plan is
the C++ trainer's bytes, not this loop's), then trains and prints the loss every 10 steps.

With --pack S the samples are the corpus's paragraphs, of every length, packed end to end into one
row per step with cu_seqlens (at most S paragraphs and N tokens a row, no padding): the TTT layers
restart at each paragraph as if it were alone. N is the planner's: membound.fit_tokens gives the
most tokens per packed row whose step fits the budget on the C++ trainer (at most --max-tokens).
"""

from __future__ import annotations

import argparse
import pathlib
import time
from typing import Optional

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

    def forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.seq_modeling_block(self.seq_norm(x), cu_seqlens)
        return x + self.mlp(self.ffn_norm(x))


class CharModel(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x, cu_seqlens)
        return self.head(self.norm(x))


def packed_rows(paragraphs: list[bytes], tokens: int, sequences: int, gen: torch.Generator):
    """Endless packed rows: (inputs [1, n], targets [1, n], cu_seqlens) with n <= tokens, each
    paragraph's inputs and next-byte targets inside its own span, paragraphs in a new random order
    each pass. A paragraph never crosses a row; none is longer than a row (main cuts them)."""
    while True:
        row: list[bytes] = []
        for i in torch.randperm(len(paragraphs), generator=gen).tolist():
            p = paragraphs[i]
            if row and (len(row) == sequences or sum(len(q) - 1 for q in row) + len(p) - 1 > tokens):
                yield pack(row)
                row = []
            row.append(p)
        if row:
            yield pack(row)


def pack(row: list[bytes]):
    inputs = torch.tensor([b for p in row for b in p[:-1]], dtype=torch.long)[None]
    targets = torch.tensor([b for p in row for b in p[1:]], dtype=torch.long)[None]
    lengths = torch.tensor([len(p) - 1 for p in row])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    return inputs, targets, cu


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
    ap.add_argument("--pack", type=int, default=0, help="train on paragraphs, at most this many packed per row")
    ap.add_argument("--max-tokens", type=int, default=1024, help="with --pack: the most tokens a row may hold")
    args = ap.parse_args()

    text = pathlib.Path(args.data).read_bytes()
    data = torch.tensor(list(text), dtype=torch.long)
    described = membound.Model(layers=["ttt_linear"] * args.blocks, width=args.width, heads=args.heads, vocab=256)
    threads = torch.get_num_threads()
    if args.pack > 0:
        # The most tokens per packed row whose step fits the budget, for any packing of at most
        # --pack paragraphs into it (the plan is the worst case over them).
        plan = membound.fit_tokens(described, max_tokens=args.max_tokens, sequences=args.pack, budget=args.budget,
                                   threads=threads)
    else:
        plan = membound.fit(described, batch=args.batch, seq=args.seq, budget=args.budget, threads=threads)
    print(f"membound's plan for this model on its C++ trainer, budget {args.budget}:")
    print(plan)
    if args.pack > 0:
        return train_packed(args, text, plan.seq)

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


def train_packed(args: argparse.Namespace, text: bytes, tokens: int) -> int:
    paragraphs = [p for p in text.split(b"\n\n") if len(p) >= 2]
    # A paragraph longer than a row (tokens inputs + 1) is cut into rows' worth: said, never hidden.
    long = sum(1 for p in paragraphs if len(p) > tokens + 1)
    paragraphs = [p[i:i + tokens + 1] for p in paragraphs for i in range(0, len(p) - 1, tokens)]
    print(f"packed: {len(paragraphs):,} paragraphs of 2 to {max(map(len, paragraphs))} bytes, at most "
          f"{args.pack} and {tokens} tokens a row (membound.fit_tokens), no padding; "
          f"{long} longer than a row, cut")
    torch.manual_seed(0)
    model = CharModel(256, args.width, args.heads, args.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rows = packed_rows(paragraphs, tokens, args.pack, torch.Generator().manual_seed(1))
    start, first, seen = time.perf_counter(), None, 0
    for step in range(1, args.steps + 1):
        inputs, targets, cu = next(rows)
        logits = model(inputs, cu)
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        seen += inputs.numel()
        first = loss.item() if first is None else first
        if step % 10 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.4f}  {cu.numel() - 1} paragraphs, {inputs.numel()} tokens  "
                  f"{seen / (time.perf_counter() - start):,.0f} tokens/s")
    print(f"loss {first:.4f} -> {loss.item():.4f} over {args.steps} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
