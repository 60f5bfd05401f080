#!/usr/bin/env python3
"""Rebuilds, in PyTorch float64, each layer dumped by dump_attention_reference.cpp and compares
the naive reference's forward (y, lse), backward (dx, dWq, dWk, dWv, dWo, against autograd) and
KV-cache decoding with it. A tool to run and report, not part of ctest.

    g++ -std=c++20 -O2 -I include bench/peers/dump_attention_reference.cpp -o /tmp/dump_attention
    /tmp/dump_attention > /tmp/attention_reference.json
    python3 bench/peers/attention_reference_check.py /tmp/attention_reference.json

The PyTorch layer is what a user would write: nn.Linear(bias=False) projections (weight = our
W transposed, since ours is y = x·W with W [in, out]), RoPE in the rotate-half (LLaMA / GPT-NeoX)
form, GQA by repeat_interleave of the kv heads, F.scaled_dot_product_attention(is_causal=...).
Exit status 1 when any relative difference (max|ours - torch| / max|torch|) exceeds --tol.
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

f64 = torch.float64


def rotate_half(x):
    d = x.shape[-1] // 2
    return torch.cat([-x[..., d:], x[..., :d]], dim=-1)


def rope(x, positions, base):
    # x [B, heads, T, D]; inv_freq_i = 1 / base^(2i/D); angles [T, D/2] repeated to [T, D]
    D = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=f64) / D))
    angles = positions.to(f64)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return x * emb.cos() + rotate_half(x) * emb.sin()


def linear(w_in_out, C_in, C_out):
    lin = torch.nn.Linear(C_in, C_out, bias=False, dtype=f64)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor(w_in_out, dtype=f64).view(C_in, C_out).T)
    return lin


def check_case(case, tol):
    c = case["config"]
    keys = ("batch", "seq", "d_model", "heads", "kv_heads", "head_dim")
    B, T, C, H, Hkv, D = (c[k] for k in keys)
    causal, base, offset = c["causal"], c["rope_base"], c["position_offset"]
    wq, wk = linear(case["wq"], C, H * D), linear(case["wk"], C, Hkv * D)
    wv, wo = linear(case["wv"], C, Hkv * D), linear(case["wo"], H * D, C)
    x = torch.tensor(case["x"], dtype=f64).view(B, T, C).requires_grad_(True)
    dy = torch.tensor(case["dy"], dtype=f64).view(B, T, C)

    positions = torch.arange(offset, offset + T)
    q = rope(wq(x).view(B, T, H, D).transpose(1, 2), positions, base)    # [B, H, T, D]
    k = rope(wk(x).view(B, T, Hkv, D).transpose(1, 2), positions, base)  # [B, Hkv, T, D]
    v = wv(x).view(B, T, Hkv, D).transpose(1, 2)
    k = k.repeat_interleave(H // Hkv, dim=1)  # head h reads kv head h // (H / Hkv)
    v = v.repeat_interleave(H // Hkv, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)       # [B, H, T, D]
    y = wo(o.transpose(1, 2).reshape(B, T, H * D))                      # [B, T, C]

    # SDPA does not return its logsumexp: compute it from the scores directly.
    with torch.no_grad():
        s = q @ k.transpose(-1, -2) / D ** 0.5
        if causal:
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)                                # [B, H, T]

    (y * dy).sum().backward()
    torch_vals = {
        "y": y.detach(), "lse": lse, "dx": x.grad,
        # nn.Linear.weight.grad is dW transposed: back to [in, out]
        "dwq": wq.weight.grad.T, "dwk": wk.weight.grad.T,
        "dwv": wv.weight.grad.T, "dwo": wo.weight.grad.T,
    }
    if "step_y" in case:
        torch_vals["step_y"] = y.detach()
    errors = {}
    for name, want in torch_vals.items():
        ours = torch.tensor(case[name], dtype=f64).view(want.shape)
        diff, scale = (ours - want).abs().max().item(), want.abs().max().item()
        # A tensor that is exactly zero (dWq, dWk at T = 1: one key, softmax 1) is compared
        # absolutely; NaN counts as failure rather than vanishing from max().
        err = diff / scale if scale > 0 else diff
        errors[name] = err if err == err else float("inf")
    worst = max(errors.values())
    status = "ok" if worst <= tol else "FAIL"
    detail = " ".join(f"{k}={v:.1e}" for k, v in errors.items())
    print(f"{status:4} {case['name']:28} max rel {worst:.2e}  ({detail})")
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump", help="JSON written by dump_attention_reference")
    ap.add_argument("--tol", type=float, default=1e-12)
    args = ap.parse_args()
    torch.manual_seed(0)
    with open(args.dump) as f:
        cases = json.load(f)
    print(f"torch {torch.__version__}, float64, CPU")
    worst = max(check_case(c, args.tol) for c in cases)
    print(f"worst relative difference over {len(cases)} layers: {worst:.2e} (tol {args.tol:g})")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
