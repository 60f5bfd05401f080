#!/usr/bin/env python3
"""Rebuilds each mixture-of-experts layer dumped by dump_moe.cpp as transformers'
MixtralSparseMoeBlock (upstream's code, run outside the repository) in float64, and compares
membound's output, balancing loss and backward (dx and every weight gradient, against autograd of
sum(y * dy) + aux) with it. A tool to run and report, not part of ctest.

    pip install transformers          # upstream's Mixtral block (no model weights are downloaded)
    g++ -std=c++20 -O2 -I include bench/peers/dump_moe.cpp -o /tmp/dump_moe
    /tmp/dump_moe > /tmp/moe.json
    python3 bench/peers/moe_reference_check.py /tmp/moe.json

The layers run without a capacity, top-2, renormalized: Mixtral's routing (softmax over the
experts, the two most probable, their probabilities divided by their sum; SwiGLU experts,
silu(x W_gate) * (x W_up) W_down). Mixtral has no capacity and no top-1 with raw gates, so the
drops and Switch's top-1 stay checked against our own per-token loop (tests/unit/test_moe.cpp).
The balancing loss is upstream's load_balancing_loss_func on the block's router logits (one layer)
times aux_loss_weight.

Upstream's router casts its logits to float32 before the softmax (router_logits.float()), and
load_balancing_loss_func accumulates in float32. The check runs twice: as upstream is (the
differences are float32's, about 1e-7), and with those two casts made float64 (two upstream
lines patched at run time, printed with the results), where the only differences left are the
order of sums. Weights come from the dump in our layout (y = x·W): gate.weight = router^T,
experts.gate_up_proj[e] = [w_gate[e]^T; w_up[e]^T], experts.down_proj[e] = w_down[e]^T. Exit
status 1 when any relative difference (max|ours - theirs| / max|theirs|) exceeds --tol (float64
run) or --tol32 (as upstream is).
"""
import argparse
import inspect
import json
import sys

import torch
import torch.nn.functional as F

import transformers
from transformers.models.mixtral import modeling_mixtral as mm

f64 = torch.float64


def as_float64(router_and_loss):
    """The router's forward and load_balancing_loss_func with upstream's float32 casts made
    float64, compiled from upstream's own source with those two substitutions."""
    if not router_and_loss:
        return mm.MixtralTopKRouter.forward, mm.load_balancing_loss_func
    patched = {}
    for name, fn, swaps in (("forward", mm.MixtralTopKRouter.forward, [("router_logits.float()", "router_logits.double()")]),
                            ("load_balancing_loss_func", mm.load_balancing_loss_func,
                             [("dtype=torch.float32", "dtype=torch.float64"), ("routing_weights.float()", "routing_weights.double()")])):
        src = inspect.getsource(fn)
        indent = len(src) - len(src.lstrip())
        src = "\n".join(line[indent:] for line in src.splitlines())
        for a, b in swaps:
            if a not in src:
                sys.exit(f"upstream changed: '{a}' not found in {name}")
            src = src.replace(a, b)
        # histc in float64 on the CPU: the counts are exact either way.
        namespace = dict(vars(mm))
        exec(compile(src, f"<patched {name}>", "exec"), namespace)
        patched[name] = namespace[name]
    return patched["forward"], patched["load_balancing_loss_func"]


def rel(ours, theirs):
    ours = torch.as_tensor(ours, dtype=f64).reshape(theirs.shape)
    scale = theirs.abs().max().item()
    return (ours - theirs).abs().max().item() / (scale if scale > 0 else 1.0)


def check_case(case, double_casts):
    c = case["config"]
    B, T, C, Fh, E = c["batch"], c["seq"], c["width"], c["hidden"], c["experts"]
    cfg = mm.MixtralConfig(hidden_size=C, intermediate_size=Fh, num_local_experts=E, num_experts_per_tok=2,
                           router_jitter_noise=0.0, hidden_act="silu")
    forward, lb_loss = as_float64(double_casts)
    block = mm.MixtralSparseMoeBlock(cfg).to(f64)
    block.gate.forward = forward.__get__(block.gate)
    with torch.no_grad():
        block.gate.weight.copy_(torch.tensor(case["router"], dtype=f64).view(C, E).t())
        wg = torch.tensor(case["w_gate"], dtype=f64).view(E, C, Fh)
        wu = torch.tensor(case["w_up"], dtype=f64).view(E, C, Fh)
        wd = torch.tensor(case["w_down"], dtype=f64).view(E, Fh, C)
        block.experts.gate_up_proj.copy_(torch.cat([wg.transpose(1, 2), wu.transpose(1, 2)], dim=1))
        block.experts.down_proj.copy_(wd.transpose(1, 2))
    x = torch.tensor(case["x"], dtype=f64).view(B, T, C).requires_grad_(True)
    dy = torch.tensor(case["dy"], dtype=f64).view(B, T, C)
    y = block(x)
    logits, _, _ = block.gate(x.view(-1, C))
    aux = c["aux_loss_weight"] * lb_loss((logits,), E, 2)
    ((y * dy).sum() + aux).backward()
    gate_up = block.experts.gate_up_proj.grad
    got = {
        "y": rel(case["y"], y.detach()),
        "aux_loss": abs(case["aux_loss"] - aux.item()) / abs(aux.item()),
        "dx": rel(case["dx"], x.grad),
        "d_router": rel(case["d_router"], block.gate.weight.grad.t()),
        "d_w_gate": rel(case["d_w_gate"], gate_up[:, :Fh, :].transpose(1, 2)),
        "d_w_up": rel(case["d_w_up"], gate_up[:, Fh:, :].transpose(1, 2)),
        "d_w_down": rel(case["d_w_down"], block.experts.down_proj.grad.transpose(1, 2)),
    }
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dump")
    ap.add_argument("--tol", type=float, default=1e-12, help="bound with upstream's float32 casts made float64")
    ap.add_argument("--tol32", type=float, default=1e-5, help="bound with upstream as it is")
    args = ap.parse_args()
    cases = json.load(open(args.dump))
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    worst_ok = True
    for double_casts, tol in ((False, args.tol32), (True, args.tol)):
        label = "router and loss in float64 (patched)" if double_casts else "upstream as it is (float32 router)"
        print(f"\n{label}; bound {tol:g}")
        for case in cases:
            if case["dropped"] != 0:
                sys.exit(f"{case['name']}: the dump dropped choices; Mixtral has no capacity")
            got = check_case(case, double_casts)
            worst = max(got.values())
            worst_ok &= worst <= tol
            print(f"  {case['name']}: " + ", ".join(f"{k} {v:.2e}" for k, v in got.items()) +
                  ("" if worst <= tol else "  <-- over the bound"))
    return 0 if worst_ok else 1


if __name__ == "__main__":
    sys.exit(main())
