#!/usr/bin/env python3
"""Rebuilds, in PyTorch float64, each Mamba-1 block dumped by dump_mamba_reference.cpp and
compares the naive reference's forward (out, last state), backward (dx and the nine parameter
gradients, against autograd) and single-step decoding with it. A tool to run and report, not
part of ctest.

    g++ -std=c++20 -O2 -I include bench/peers/dump_mamba_reference.cpp -o /tmp/dump_mamba
    /tmp/dump_mamba > /tmp/mamba_reference.json
    python3 bench/peers/mamba_reference_check.py /tmp/mamba_reference.json

The PyTorch block is written the way state-spaces/mamba's Mamba (mamba_ssm/modules/
mamba_simple.py) runs without its fused kernels: in_proj as `weight @ x` with no bias, then
nn.Conv1d(groups=Di, padding=K-1, bias=True) truncated to the first T outputs, SiLU, x_proj
Linear, dt_proj as `weight @ dt` with its bias added inside the scan before softplus, a
selective_scan_ref-style loop over time with the D skip and the silu(z) gate, out_proj; and
Mamba.step's slow path (the conv state rolled, the ssm state updated) for decoding. Nothing is
cast to float32 (upstream keeps A_log and D in fp32 and its reference scan upcasts to fp32):
here every tensor is float64 so the comparison measures the reference, not the precision.

Weights come from the dump in our layout (y = x·W, W [in, out]): nn.Linear.weight = W
transposed, conv1d.weight [Di, 1, K] = conv_w [Di, K]. Exit status 1 when any relative
difference (max|ours - torch| / max|torch|) exceeds --tol.
"""
import argparse
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

f64 = torch.float64


def tensor(values, *shape):
    return torch.tensor(values, dtype=f64).view(*shape)


def selective_scan(u, delta, A, Bm, Cm, D, z, delta_bias):
    """selective_scan_ref's semantics with delta_softplus=True, variable B and C, real A.

    u, delta, z: [b, d, l]; A: [d, n]; Bm, Cm: [b, n, l]; D, delta_bias: [d].
    Returns out [b, d, l] and the state after the last step [b, d, n].
    """
    pre = delta + delta_bias[:, None]
    # F.softplus returns its input unchanged above threshold 20 (an error of log1p(e^-20) ~ 2e-9
    # against log(1 + e^v)); keep every case below it so the comparison is exact softplus.
    assert pre.max().item() < 20.0, "dt pre-activation reached F.softplus's threshold"
    delta = F.softplus(pre)
    batch, dim, seqlen = u.shape
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))       # exp(delta·A)
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, Bm, u)          # delta·B·u
    h = torch.zeros(batch, dim, A.shape[1], dtype=f64)
    ys = []
    for t in range(seqlen):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", h, Cm[:, :, t]))
    y = torch.stack(ys, dim=2)                                     # [b, d, l]
    out = y + u * D[:, None]
    return out * F.silu(z), h


class MambaBlock(nn.Module):
    def __init__(self, case):
        super().__init__()
        c = case["config"]
        C, Di, N, K, R = (c[k] for k in ("d_model", "d_inner", "d_state", "d_conv", "dt_rank"))
        self.C, self.Di, self.N, self.K, self.R = C, Di, N, K, R
        self.in_proj = nn.Linear(C, 2 * Di, bias=False, dtype=f64)
        self.conv1d = nn.Conv1d(Di, Di, kernel_size=K, groups=Di, padding=K - 1, bias=True,
                                dtype=f64)
        self.act = nn.SiLU()
        self.x_proj = nn.Linear(Di, R + 2 * N, bias=False, dtype=f64)
        self.dt_proj = nn.Linear(R, Di, bias=True, dtype=f64)
        self.A_log = nn.Parameter(tensor(case["a_log"], Di, N))
        self.D = nn.Parameter(tensor(case["d"], Di))
        self.out_proj = nn.Linear(Di, C, bias=False, dtype=f64)
        with torch.no_grad():
            self.in_proj.weight.copy_(tensor(case["in_proj"], C, 2 * Di).T)
            self.conv1d.weight.copy_(tensor(case["conv_w"], Di, 1, K))
            self.conv1d.bias.copy_(tensor(case["conv_b"], Di))
            self.x_proj.weight.copy_(tensor(case["x_proj"], Di, R + 2 * N).T)
            self.dt_proj.weight.copy_(tensor(case["dt_proj"], R, Di).T)
            self.dt_proj.bias.copy_(tensor(case["dt_bias"], Di))
            self.out_proj.weight.copy_(tensor(case["out_proj"], Di, C).T)

    def forward(self, hidden):
        """Mamba.forward without an inference cache or fused kernels: hidden [b, l, C]."""
        b, l, _ = hidden.shape
        Di, N, R = self.Di, self.N, self.R
        # xz = rearrange(in_proj.weight @ rearrange(hidden, "b l d -> d (b l)"), "d (b l) -> b d l")
        xz = (self.in_proj.weight @ hidden.reshape(b * l, -1).T).reshape(2 * Di, b, l)
        xz = xz.permute(1, 0, 2)
        A = -torch.exp(self.A_log)
        x, z = xz.chunk(2, dim=1)                                  # [b, Di, l] each
        x = self.act(self.conv1d(x)[..., :l])
        x_dbl = self.x_proj(x.permute(0, 2, 1).reshape(b * l, Di))  # [(b l), R + 2N]
        dt, Bm, Cm = torch.split(x_dbl, [R, N, N], dim=-1)
        dt = (self.dt_proj.weight @ dt.t()).reshape(Di, b, l).permute(1, 0, 2)  # [b, Di, l]
        Bm = Bm.reshape(b, l, N).permute(0, 2, 1)                  # [b, N, l]
        Cm = Cm.reshape(b, l, N).permute(0, 2, 1)
        y, last_state = selective_scan(x, dt, A, Bm, Cm, self.D, z, self.dt_proj.bias)
        return self.out_proj(y.permute(0, 2, 1)), last_state

    @torch.no_grad()
    def step(self, hidden, conv_state, ssm_state):
        """Mamba.step's slow path: hidden [b, 1, C]; conv_state [b, Di, K]; ssm_state [b, Di, N]."""
        xz = self.in_proj(hidden.squeeze(1))                       # [b, 2Di]
        x, z = xz.chunk(2, dim=-1)
        conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
        conv_state[:, :, -1] = x
        x = torch.sum(conv_state * self.conv1d.weight.squeeze(1), dim=-1) + self.conv1d.bias
        x = self.act(x)
        x_db = self.x_proj(x)
        dt, Bm, Cm = torch.split(x_db, [self.R, self.N, self.N], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight)                     # bias added below
        A = -torch.exp(self.A_log)
        dt = F.softplus(dt + self.dt_proj.bias)
        dA = torch.exp(torch.einsum("bd,dn->bdn", dt, A))
        dB = torch.einsum("bd,bn->bdn", dt, Bm)
        ssm_state.copy_(ssm_state * dA + x.unsqueeze(-1) * dB)
        y = torch.einsum("bdn,bn->bd", ssm_state, Cm) + self.D * x
        y = y * self.act(z)
        return self.out_proj(y).unsqueeze(1)


def rel(ours, want):
    if want.numel() == 0:
        return 0.0 if ours.numel() == 0 else float("inf")
    diff, scale = (ours - want).abs().max().item(), want.abs().max().item()
    # An exactly-zero tensor (d_a_log at T = 1: A multiplies h_{-1} = 0) is compared absolutely;
    # NaN counts as failure rather than vanishing from max().
    err = diff / scale if scale > 0 else diff
    return err if err == err else float("inf")


def check_case(case, tol):
    c = case["config"]
    B, T, C, Di, N, K = (c[k] for k in ("batch", "seq", "d_model", "d_inner", "d_state", "d_conv"))
    m = MambaBlock(case)
    x = tensor(case["x"], B, T, C).requires_grad_(True)
    dy = tensor(case["dy"], B, T, C)
    out, last_state = m(x)
    (out * dy).sum().backward()

    conv_state = torch.zeros(B, Di, K, dtype=f64)  # upstream's state holds K values
    ssm_state = torch.zeros(B, Di, N, dtype=f64)
    step_out = torch.cat([m.step(x.detach()[:, t:t + 1], conv_state, ssm_state)
                          for t in range(T)], dim=1)

    torch_vals = {
        "out": out.detach(),
        "h_last": last_state.detach(),
        "dx": x.grad,
        # nn.Linear.weight.grad is dW transposed: back to [in, out]
        "d_in_proj": m.in_proj.weight.grad.T,
        "d_conv_w": m.conv1d.weight.grad.view(Di, K),
        "d_conv_b": m.conv1d.bias.grad,
        "d_x_proj": m.x_proj.weight.grad.T,
        "d_dt_proj": m.dt_proj.weight.grad.T,
        "d_dt_bias": m.dt_proj.bias.grad,
        "d_a_log": m.A_log.grad,
        "d_d": m.D.grad,
        "d_out_proj": m.out_proj.weight.grad.T,
        "step_out": step_out,
        # ours keeps the last K-1 values of xi; upstream's K-wide state ends with the same ones
        "step_conv_state": conv_state[:, :, 1:],
        "step_ssm_state": ssm_state,
    }
    errors = {}
    for name, want in torch_vals.items():
        ours = torch.tensor(case[name], dtype=f64).view(want.shape)
        errors[name] = rel(ours, want)
    # Our stepped outputs against torch's full forward, too.
    errors["step_out~out"] = rel(torch.tensor(case["step_out"], dtype=f64).view(B, T, C),
                                 out.detach())
    worst = max(errors.values())
    status = "ok" if worst <= tol else "FAIL"
    print(f"{status:4} {case['name']:26} max rel {worst:.2e}")
    for name, err in errors.items():
        print(f"       {name:16} {err:.2e}")
    return worst, errors


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump", help="JSON written by dump_mamba_reference")
    ap.add_argument("--tol", type=float, default=1e-10)
    args = ap.parse_args()
    torch.manual_seed(0)
    with open(args.dump) as f:
        cases = json.load(f)
    print(f"torch {torch.__version__}, float64, CPU")
    results = [check_case(c, args.tol) for c in cases]
    per_tensor = {}
    for _, errors in results:
        for name, err in errors.items():
            per_tensor[name] = max(per_tensor.get(name, 0.0), err)
    print("worst per tensor over all blocks: " +
          " ".join(f"{k}={v:.1e}" for k, v in per_tensor.items()))
    worst = max(w for w, _ in results)
    print(f"worst relative difference over {len(cases)} blocks: {worst:.2e} (tol {args.tol:g})")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
