#!/usr/bin/env python3
"""Rebuilds, in PyTorch float64, each TTT layer dumped by dump_ttt_reference.cpp and compares the
naive reference's forward (out, ttt_out), backward (dx and every parameter gradient, against
autograd) and single-step decoding (outputs and final state) with it. A tool to run and report,
not part of ctest.

    g++ -std=c++20 -O2 -I include bench/peers/dump_ttt_reference.cpp -o /tmp/dump_ttt
    /tmp/dump_ttt > /tmp/ttt_reference.json
    python3 bench/peers/ttt_reference_check.py /tmp/ttt_reference.json

The PyTorch layer is written (by us) the way test-time-training/ttt-lm-pytorch's TTTLinear /
TTTMLP (ttt.py) compute it, without share_qk / pre_conv: bias-free q/k/v/o (and g) projections;
RoPE at position_ids % mini_batch_size applied as upstream does, between a [D/2, 2] -> [2, D/2]
permutation of each head and its inverse around the rotate-half formula; get_eta (sigmoid of a
per-head linear map of the layer input, times ttt_base_lr / head_dim, times the clamped
token_idx + learnable_token_idx); the inner loop in upstream's prefill DUAL form (one mini-batch
at a time, the LayerNorm-fused L2 gradient, tril(XQ·XKᵀ) attention-like updates, the last row of
eta updating the carried weights), the sequence split into full mini-batches and a shorter
remainder that continues from the last full one's weights; post_norm LayerNorm(eps 1e-6); the
tanh-GELU gate; o_proj. Decoding uses upstream's PRIMAL form with TTTCache semantics (per-token
W_states / W_grad, the grad reset at a mini-batch boundary).

Differences from upstream, all for the comparison to measure the reference rather than precision:
every tensor is float64 (upstream computes RoPE's cos/sin in float32 and holds token_idx =
1/(i+1) in a float32 buffer), and gelu_bwd uses the exact sqrt(2/pi) rather than upstream's
rounded 0.79788456 / 0.1070322243 (pass --upstream-gelu-constants to see what those change:
about 1e-9 relative in gelu', up to ~5e-10 in the decode state and ~5e-11 in out/gradients).

Weights come from the dump in our layout (y = x·W, W [in, out]): nn.Linear.weight = W
transposed; W1/W2 are upstream's [H, D, F] / [H, F, D] as they are; b1/b2/lr_bias/lr_weight get
upstream's singleton axis. Exit status 1 when any relative difference (max|ours - torch| /
max|torch|) exceeds --tol.
"""
import argparse
import json
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

f64 = torch.float64
GELU_C = math.sqrt(2.0 / math.pi)


def tensor(values, *shape):
    return torch.tensor(values, dtype=f64).view(*shape)


def gelu_bwd(x, upstream_constants):
    """d/dx of F.gelu(x, approximate="tanh")."""
    c, c3 = (0.79788456, 0.1070322243) if upstream_constants else (GELU_C, 3 * 0.044715 * GELU_C)
    t = torch.tanh(c * x * (1 + 0.044715 * x * x))
    return 0.5 * x * ((1 - t * t) * (c + c3 * x * x)) + 0.5 * (1 + t)


def ln_fwd(x, gamma, beta, eps):
    mu = x.mean(dim=-1, keepdim=True)
    var = x.var(dim=-1, keepdim=True, unbiased=False)
    return gamma * (x - mu) / torch.sqrt(var + eps) + beta


def ln_fused_l2_bwd(x, target, gamma, beta, eps):
    """Gradient of 0.5 * ||LN(x) - target||^2 with respect to x, over the last axis."""
    n = x.shape[-1]
    mu = x.mean(dim=-1, keepdim=True)
    var = x.var(dim=-1, keepdim=True, unbiased=False)
    std = torch.sqrt(var + eps)
    x_hat = (x - mu) / std
    g_hat = (gamma * x_hat + beta - target) * gamma
    return (n * g_hat - g_hat.sum(dim=-1, keepdim=True)
            - x_hat * (g_hat * x_hat).sum(dim=-1, keepdim=True)) / (n * std)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def to_halves(x):
    """Upstream's permute_qk on one tensor: [..., D] viewed [..., D/2, 2] -> [..., 2, D/2]."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2).transpose(-1, -2).reshape(x.shape)


def from_halves(x):
    """Upstream's undo_permute_qk: [..., 2, D/2] -> [..., D/2, 2]."""
    return x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2).transpose(-1, -2).reshape(x.shape)


class TTTLayer(nn.Module):
    def __init__(self, case, upstream_gelu):
        super().__init__()
        c = case["config"]
        self.C, self.H, self.b = c["width"], c["heads"], c["mini_batch"]
        self.D = self.C // self.H
        self.mlp = c["kind"] == "mlp"
        self.F = 4 * self.D if self.mlp else self.D
        self.use_gate = c["use_gate"]
        self.base_lr, self.rope_base = c["base_lr"], c["rope_base"]
        self.ttt_eps = c["ttt_norm_eps"]
        self.upstream_gelu = upstream_gelu
        C, H, D, Fh, b = self.C, self.H, self.D, self.F, self.b

        def linear(name):
            m = nn.Linear(C, C, bias=False, dtype=f64)
            with torch.no_grad():
                m.weight.copy_(tensor(case[name], C, C).T)
            return m

        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            linear(n) for n in ("wq", "wk", "wv", "wo"))
        if self.use_gate:
            self.g_proj = linear("wg")
        self.learnable_ttt_lr_weight = nn.Parameter(tensor(case["lr_weight"], H, 1, C))
        self.learnable_ttt_lr_bias = nn.Parameter(tensor(case["lr_bias"], H, 1))
        self.register_buffer("token_idx", 1.0 / torch.arange(1, b + 1, dtype=f64))
        self.learnable_token_idx = nn.Parameter(tensor(case["token_offset"], b))
        self.ttt_norm_weight = nn.Parameter(tensor(case["ttt_norm_weight"], H, D))
        self.ttt_norm_bias = nn.Parameter(tensor(case["ttt_norm_bias"], H, D))
        self.post_norm = nn.LayerNorm(C, eps=c["post_norm_eps"], dtype=f64)
        with torch.no_grad():
            self.post_norm.weight.copy_(tensor(case["post_norm_weight"], C))
            self.post_norm.bias.copy_(tensor(case["post_norm_bias"], C))
        self.W1 = nn.Parameter(tensor(case["w1"], H, D, Fh))
        self.b1 = nn.Parameter(tensor(case["b1"], H, 1, Fh))
        if self.mlp:
            self.W2 = nn.Parameter(tensor(case["w2"], H, Fh, D))
            self.b2 = nn.Parameter(tensor(case["b2"], H, 1, D))

    # --- pieces shared by both forms -------------------------------------------------------
    def rope(self, q, k, positions):
        """q, k [B, H, L, D]; positions [L] (already mod b)."""
        D = self.D
        inv_freq = 1.0 / (self.rope_base ** (torch.arange(0, D, 2, dtype=f64) / D))
        freqs = positions.to(f64)[:, None] * inv_freq[None, :]        # [L, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                       # [L, D]
        cos, sin = emb.cos(), emb.sin()
        q, k = to_halves(q), to_halves(k)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return from_halves(q), from_halves(k)

    def qkv(self, x, positions):
        B, L, _ = x.shape
        split = lambda t: t.reshape(B, L, self.H, self.D).transpose(1, 2)   # [B, H, L, D]
        XQ, XK, XV = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        XQ, XK = self.rope(XQ, XK, positions)
        return XQ, XK, XV

    def lr_eta(self, x):
        """ttt_lr_eta: base_lr * sigmoid(x . w_h + b_h) / D, x [B, L, C] -> [B, H, L]."""
        logit = torch.einsum("blc,hdc->bhld", x, self.learnable_ttt_lr_weight)[..., 0]
        logit = logit + self.learnable_ttt_lr_bias.reshape(1, self.H, 1)
        return self.base_lr * torch.sigmoid(logit) / self.D

    def token_eta(self, first, n):
        return torch.clamp_min(self.token_idx[first:first + n]
                               + self.learnable_token_idx[first:first + n], 0.0)

    def inner_grads(self, params, XK, XV):
        """Z-gradients of the inner loss at params: returns (G1, G2, X2) per token row."""
        gamma = self.ttt_norm_weight.reshape(self.H, 1, self.D)
        beta = self.ttt_norm_bias.reshape(self.H, 1, self.D)
        target = XV - XK
        Z1 = XK @ params["W1"] + params["b1"]
        if not self.mlp:
            return ln_fused_l2_bwd(Z1, target, gamma, beta, self.ttt_eps), None, None
        X2 = F.gelu(Z1, approximate="tanh")
        Z2 = X2 @ params["W2"] + params["b2"]
        G2 = ln_fused_l2_bwd(Z2, target, gamma, beta, self.ttt_eps)
        G1 = (G2 @ params["W2"].transpose(-2, -1)) * gelu_bwd(Z1, self.upstream_gelu)
        return G1, G2, X2

    def finish(self, x, ttt_out):
        out = self.post_norm(ttt_out)
        if self.use_gate:
            out = F.gelu(self.g_proj(x), approximate="tanh") * out
        return self.o_proj(out)

    def initial_params(self, B):
        names = ["W1", "b1"] + (["W2", "b2"] if self.mlp else [])
        return {n: getattr(self, n).unsqueeze(0).expand(B, *getattr(self, n).shape) for n in names}

    # --- prefill: upstream's dual form -----------------------------------------------------
    def dual_mini_batch(self, params, XQ, XK, XV, eta):
        """One mini-batch of K tokens: XQ/XK/XV [B, H, K, D], eta [B, H, K, K]."""
        gamma = self.ttt_norm_weight.reshape(self.H, 1, self.D)
        beta = self.ttt_norm_bias.reshape(self.H, 1, self.D)
        G1, G2, X2 = self.inner_grads(params, XK, XV)
        tril_eta = torch.tril(eta)
        Attn1 = torch.tril(XQ @ XK.transpose(-2, -1))
        b1_bar = params["b1"] - tril_eta @ G1
        Z1_bar = XQ @ params["W1"] - (eta * Attn1) @ G1 + b1_bar
        last = eta[:, :, -1, :, None]                                  # [B, H, K, 1]
        new = {"W1": params["W1"] - (last * XK).transpose(-1, -2) @ G1,
               "b1": params["b1"] - torch.sum(last * G1, dim=-2, keepdim=True)}
        Z_bar = Z1_bar
        if self.mlp:
            X2_bar = F.gelu(Z1_bar, approximate="tanh")
            Attn2 = torch.tril(X2_bar @ X2.transpose(-2, -1))
            b2_bar = params["b2"] - tril_eta @ G2
            Z_bar = X2_bar @ params["W2"] - (eta * Attn2) @ G2 + b2_bar
            new["W2"] = params["W2"] - (last * X2).transpose(-1, -2) @ G2
            new["b2"] = params["b2"] - torch.sum(last * G2, dim=-2, keepdim=True)
        return new, XQ + ln_fwd(Z_bar, gamma, beta, self.ttt_eps)

    def forward(self, x):
        """x [B, L, C] -> out [B, L, C] and ttt_out [B, L, C] (before post_norm)."""
        B, L, _ = x.shape
        b = self.b
        XQ, XK, XV = self.qkv(x, torch.arange(L) % b)
        lr = self.lr_eta(x)                                            # [B, H, L]
        params = self.initial_params(B)
        outs = []
        # Full mini-batches, then the remainder (a call with mini_batch_size = L % b upstream)
        # continuing from the last full mini-batch's weights; token_idx sliced from 0 in both.
        for start in range(0, L, b):
            K = min(b, L - start)
            sl = slice(start, start + K)
            eta = self.token_eta(0, K).reshape(1, 1, K, 1) * lr[:, :, None, sl]  # [B, H, K, K]
            params, o = self.dual_mini_batch(params, XQ[:, :, sl], XK[:, :, sl], XV[:, :, sl],
                                             eta)
            outs.append(o)
        ttt_out = torch.cat(outs, dim=2).transpose(1, 2).reshape(B, L, self.C)
        return self.finish(x, ttt_out), ttt_out

    # --- decoding: upstream's primal form with TTTCache semantics -------------------------
    @torch.no_grad()
    def decode(self, x):
        """Token by token; returns outputs [B, L, C] and the final (states, grads) dicts."""
        B, L, _ = x.shape
        gamma = self.ttt_norm_weight.reshape(self.H, 1, self.D)
        beta = self.ttt_norm_bias.reshape(self.H, 1, self.D)
        states = {n: p.clone() for n, p in self.initial_params(B).items()}
        grads = {n: torch.zeros_like(p) for n, p in states.items()}
        outs = []
        for t in range(L):
            i = t % self.b
            xt = x[:, t:t + 1]
            XQ, XK, XV = self.qkv(xt, torch.tensor([i]))               # [B, H, 1, D]
            lr = self.lr_eta(xt)[..., None]                            # [B, H, 1, 1]
            tok = self.token_eta(i, 1)
            G1, G2, X2 = self.inner_grads(states, XK, XV)
            acc = {"W1": grads["W1"] + lr * XK.transpose(-1, -2) @ G1,
                   "b1": grads["b1"] + lr * G1}
            if self.mlp:
                acc["W2"] = grads["W2"] + lr * X2.transpose(-1, -2) @ G2
                acc["b2"] = grads["b2"] + lr * G2
            bar = {n: states[n] - tok * acc[n] for n in states}
            Z = XQ @ bar["W1"] + bar["b1"]
            if self.mlp:
                Z = F.gelu(Z, approximate="tanh") @ bar["W2"] + bar["b2"]
            o = XQ + ln_fwd(Z, gamma, beta, self.ttt_eps)              # [B, H, 1, D]
            outs.append(self.finish(xt, o.transpose(1, 2).reshape(B, 1, self.C)))
            if i == self.b - 1:
                states, grads = bar, {n: torch.zeros_like(v) for n, v in acc.items()}
            else:
                grads = acc
        return torch.cat(outs, dim=1), states, grads


def rel(ours, want):
    if want.numel() == 0:
        return 0.0 if ours.numel() == 0 else float("inf")
    diff, scale = (ours - want).abs().max().item(), want.abs().max().item()
    # An exactly-zero tensor (the state's G after a complete mini-batch) is compared absolutely;
    # NaN counts as failure rather than vanishing from max().
    err = diff / scale if scale > 0 else diff
    return err if err == err else float("inf")


def check_case(case, tol, upstream_gelu):
    c = case["config"]
    B, T, C = c["batch"], c["seq"], c["width"]
    m = TTTLayer(case, upstream_gelu)
    x = tensor(case["x"], B, T, C).requires_grad_(True)
    dy = tensor(case["dy"], B, T, C)
    out, ttt_out = m(x)
    (out * dy).sum().backward()
    step_out, states, grads = m.decode(x.detach())

    T_ = lambda p: p.grad.T                     # nn.Linear.weight.grad -> our [in, out]
    torch_vals = {
        "out": out.detach(),
        "ttt_out": ttt_out.detach(),
        "dx": x.grad,
        "d_wq": T_(m.q_proj.weight), "d_wk": T_(m.k_proj.weight), "d_wv": T_(m.v_proj.weight),
        "d_ttt_norm_weight": m.ttt_norm_weight.grad, "d_ttt_norm_bias": m.ttt_norm_bias.grad,
        "d_w1": m.W1.grad, "d_b1": m.b1.grad,
        "d_lr_weight": m.learnable_ttt_lr_weight.grad, "d_lr_bias": m.learnable_ttt_lr_bias.grad,
        "d_token_offset": m.learnable_token_idx.grad,
        "d_post_norm_weight": m.post_norm.weight.grad, "d_post_norm_bias": m.post_norm.bias.grad,
        "d_wo": T_(m.o_proj.weight),
        "step_out": step_out,
        "state_w1": states["W1"], "state_b1": states["b1"],
        "state_gw1": grads["W1"], "state_gb1": grads["b1"],
    }
    if m.mlp:
        torch_vals.update({"d_w2": m.W2.grad, "d_b2": m.b2.grad,
                           "state_w2": states["W2"], "state_b2": states["b2"],
                           "state_gw2": grads["W2"], "state_gb2": grads["b2"]})
    else:
        for k in ("d_w2", "d_b2", "state_w2", "state_b2", "state_gw2", "state_gb2"):
            assert len(case[k]) == 0, k
    if m.use_gate:
        torch_vals["d_wg"] = T_(m.g_proj.weight)
    else:
        assert len(case["d_wg"]) == 0
    errors = {}
    for name, want in torch_vals.items():
        ours = torch.tensor(case[name], dtype=f64)
        assert ours.numel() == want.numel(), (name, ours.numel(), want.numel())
        errors[name] = rel(ours.view(want.shape), want)
    # Our stepped outputs against torch's full (dual-form) forward, too.
    errors["step_out~out"] = rel(torch.tensor(case["step_out"], dtype=f64).view(B, T, C),
                                 out.detach())
    worst = max(errors.values())
    status = "ok" if worst <= tol else "FAIL"
    print(f"{status:4} {case['name']:36} max rel {worst:.2e}")
    for name, err in errors.items():
        print(f"       {name:20} {err:.2e}")
    return worst, errors


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump", help="JSON written by dump_ttt_reference")
    ap.add_argument("--tol", type=float, default=1e-10)
    ap.add_argument("--upstream-gelu-constants", action="store_true",
                    help="use gelu_bwd's rounded constants (0.79788456, 0.1070322243) as upstream")
    args = ap.parse_args()
    torch.manual_seed(0)
    with open(args.dump) as f:
        cases = json.load(f)
    print(f"torch {torch.__version__}, float64, CPU"
          + (", upstream's gelu_bwd constants" if args.upstream_gelu_constants else ""))
    results = [check_case(c, args.tol, args.upstream_gelu_constants) for c in cases]
    per_tensor = {}
    for _, errors in results:
        for name, err in errors.items():
            per_tensor[name] = max(per_tensor.get(name, 0.0), err)
    print("worst per tensor over all layers: " +
          " ".join(f"{k}={v:.1e}" for k, v in per_tensor.items()))
    worst = max(w for w, _ in results)
    print(f"worst relative difference over {len(cases)} layers: {worst:.2e} (tol {args.tol:g})")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
