#!/usr/bin/env python3
"""membound's layers as PyTorch ops (membound.nn) beside what a PyTorch user runs, on the CPU:
the bytes autograd keeps for backward (every tensor saved between forward and backward, each
storage counted once, parameters excluded) and, for attention, the time of forward+backward.

    PYTHONPATH=<build>/tests/python/site python3 bench/peers/torch_ops_peer.py [--reps 5] [--json out.json]

Peers, with the same weights and inputs:
- attention: the same projections and RoPE around torch.nn.functional.scaled_dot_product_attention
  (PyTorch's fused CPU attention; is_causal=True): a speed peer.
- TTT-Linear / TTT-MLP: bench/peers/ttt_reference_check.py's module (ttt-lm-pytorch's algorithm in
  eager PyTorch, its mini-batch loop in Python): a correctness oracle; its saved bytes are what
  autograd keeps for that algorithm, its time is not a speed claim and is not printed as a ratio.
- Mamba: bench/peers/mamba_reference_check.py's module (mamba_simple's slow path, a Python loop over
  tokens): likewise bytes only.
Attention runs in float32; the TTT and Mamba rows in float64 (the oracles are written in float64),
which doubles both sides' bytes alike.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "python"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import membound.nn as mnn  # noqa: E402
import mamba_reference_check  # noqa: E402
import ttt_reference_check  # noqa: E402
from test_ops import SdpaAttention, random_mamba_case, random_ttt_case  # noqa: E402


def saved_bytes(model: torch.nn.Module, x: torch.Tensor, out=lambda y: y) -> int:
    """Bytes of the distinct storages autograd saves during forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = out(model(x))
    y.sum().backward()
    return sum(seen.values())


def fwd_bwd_seconds(model, x, reps, out=lambda y: y) -> float:
    times = []
    for _ in range(reps + 1):
        model.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        t0 = time.perf_counter()
        out(model(xi)).sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


class SdpaCausal(SdpaAttention):
    """The peer as a user writes it: SDPA with is_causal=True, no explicit mask."""

    def forward(self, x):
        m, (B, T, _) = self.m, x.shape
        H, D = m.heads, m.head_dim
        q = m.q_proj(x).view(B, T, H, D).transpose(1, 2)
        k = m.k_proj(x).view(B, T, H, D).transpose(1, 2)
        v = m.v_proj(x).view(B, T, H, D).transpose(1, 2)
        inv = 1.0 / (m.rope_base ** (torch.arange(0, D, 2, dtype=x.dtype) / D))
        ang = torch.arange(T, dtype=x.dtype)[:, None] * inv[None, :]
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        half = lambda t: torch.cat((-t[..., D // 2:], t[..., :D // 2]), -1)  # noqa: E731
        q, k = q * cos + half(q) * sin, k * cos + half(k) * sin
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return m.o_proj(o.transpose(1, 2).reshape(B, T, H * D))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    f32, f64 = torch.float32, torch.float64

    for B, T, C, H in [(4, 512, 256, 4), (1, 2048, 256, 4)]:
        ours = mnn.Attention(C, H, dtype=f32)
        peer = SdpaCausal(ours)
        x = torch.randn(B, T, C)
        t_ours, t_peer = fwd_bwd_seconds(ours, x, args.reps), fwd_bwd_seconds(peer, x, args.reps)
        rows.append({"layer": "attention", "shape": f"B{B} T{T} C{C} H{H}", "saved_ours": saved_bytes(ours, x),
                     "saved_peer": saved_bytes(peer, x), "seconds_ours": t_ours, "seconds_peer": t_peer,
                     "peer": "SDPA (torch.nn.functional.scaled_dot_product_attention, is_causal) with the same "
                             "projections and RoPE", "speed_peer": True})

    gen = torch.Generator().manual_seed(1)
    for kind, B, T, C, H in [("linear", 4, 512, 256, 4), ("mlp", 4, 512, 256, 4)]:
        ref = ttt_reference_check.TTTLayer(random_ttt_case(kind, False, B, T, C, H, gen), upstream_gelu=False)
        ours = (mnn.TTTMLP if kind == "mlp" else mnn.TTTLinear)(C, H, dtype=f64)
        ours.load_state_dict({k: v for k, v in ref.state_dict().items() if k != "token_idx"})
        x = torch.randn(B, T, C, dtype=f64)
        rows.append({"layer": f"ttt_{kind}", "shape": f"B{B} T{T} C{C} H{H}", "saved_ours": saved_bytes(ours, x),
                     "saved_peer": saved_bytes(ref, x, lambda y: y[0]),
                     "peer": "ttt-lm-pytorch's dual form in eager PyTorch (bench/peers/ttt_reference_check.py)",
                     "speed_peer": False})

    for B, T, C in [(4, 512, 256)]:
        ref = mamba_reference_check.MambaBlock(random_mamba_case(C, 2 * C, 16, 4, C // 16, gen))
        ours = mnn.Mamba(C, dtype=f64)
        ours.load_state_dict(ref.state_dict())
        x = 0.1 * torch.randn(B, T, C, dtype=f64)  # Δ's pre-activation below softplus's threshold (the oracle asserts)
        rows.append({"layer": "mamba", "shape": f"B{B} T{T} C{C}", "saved_ours": saved_bytes(ours, x),
                     "saved_peer": saved_bytes(ref, x, lambda y: y[0]),
                     "peer": "mamba_simple's slow path with selective_scan_ref (bench/peers/mamba_reference_check.py)",
                     "speed_peer": False})

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    for r in rows:
        line = (f"{r['layer']:11} {r['shape']:20} saved for backward: ours {r['saved_ours'] / 2**20:8.2f} MiB, "
                f"peer {r['saved_peer'] / 2**20:8.2f} MiB ({r['saved_ours'] / r['saved_peer']:.3f}x)")
        if r["speed_peer"]:
            line += (f"; fwd+bwd {r['seconds_ours'] * 1e3:.1f} ms vs {r['seconds_peer'] * 1e3:.1f} ms "
                     f"({r['seconds_peer'] / r['seconds_ours']:.2f}x the peer's speed)")
        print(line + f"\n            peer: {r['peer']}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
