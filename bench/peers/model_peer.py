#!/usr/bin/env python3
"""The whole training step: the example trainer's hybrid model (examples/train.cpp) against the
same model written in PyTorch on the CPU, same shape, same data, same thread count, one run. A
tool to run and report, not part of ctest.

Build the runner and run (from the repository root; torch from PyPI in a venv):

    python3 -m venv /tmp/venv-peer && /tmp/venv-peer/bin/pip install torch numpy
    cmake --preset release -DMEMBOUND_ENABLE_CUDA=OFF
    cmake --build build/release --target model_peer_runner -j1
    /tmp/venv-peer/bin/python bench/peers/model_peer.py --ours build/release/bench/model_peer_runner
    /tmp/venv-peer/bin/python bench/peers/model_peer.py --ours build/release/bench/model_peer_runner \\
          --shapes default,long --rounds 2 --check

Shapes (--shapes, comma-separated): "default" is the trainer's default run: blocks
ttt,attn,mamba,attn, width 128, 4 heads, T = 128, batch 8, budget 32 MiB; "long" is T = 4096,
width 256, 4 heads (head size 64), batch 1, the same blocks, budget --long-budget (default 256
MiB: weights, gradients and AdamW state alone are ~52 MiB at this width, so the trainer's 32 MiB
cannot hold it). Both fp32, vocab 256 (bytes), --threads threads (default 2) on both sides.

Ours: bench/peers/model_peer_runner.cpp, i.e. membound::trainer as the example trainer sets it
up (its allocator stack, fit()'s plan for the budget, AdamW, cosine schedule, clip 1); one step is
trainer::step (every micro-batch's forward, loss and backward, the gradient norm, clip, AdamW).

PyTorch: the same model as a PyTorch user writes it, fp32, torch.set_num_threads(threads):
  embedding table [256, C] (F.embedding); per block h = x + Mixer(rms_norm(x, norm1)),
  y = h + W_down(silu(W_gate n) * W_up n) with n = rms_norm(h, norm2) (F.rms_norm, eps 1e-5;
  SwiGLU hidden 8C/3 rounded up to a multiple of 8, bias-free nn.Linear); final rms_norm and
  logits = n · tableᵀ (tied); F.cross_entropy over all B·T tokens; loss.backward();
  clip_grad_norm_(1.0); torch.optim.AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1 on the
  tensors ours decays: those initialised N(0, σ²)) at the trainer's cosine learning rate
  (3e-3 -> 3e-4, 30 warm-up steps of 200). The mixers are the per-layer peers' PyTorch layers,
  imported from them: attention_peer.TorchAttention (nn.Linear projections, rotate-half RoPE,
  F.scaled_dot_product_attention, causal), mamba_peer.TorchMamba (mamba_ssm's reference path:
  selective_scan_ref over the sequence) and ttt_peer.TorchTTT (ttt-lm-pytorch's TTTLinear /
  TTTMLP dual form, scan over mini-batches of 16, no gradient checkpointing). Their shapes are
  module constants there (heads, width); each PyTorch process sets them for its one shape.
Initialisation: the same scheme as model::init_weights (mixer_traits.hpp): N(0, 0.02²) for every
projection and the embedding, norms 1, Mamba's conv taps N(0, 1/(3K)), dt_proj N(0, 1/(3R)),
dt_bias softplus⁻¹ of log-uniform [1e-3, 0.1], A_log = log(1..16), D = 1, TTT's inner norm 1/0,
biases and token offsets 0; drawn from torch's generator (seed 1), not from our splitmix64
(--check loads ours instead).
Data: tiny-shakespeare (examples/data/tinyshakespeare.txt), the first 9/10 as bytes; sequence k
of the run starts at splitmix64(k) mod (n - T - 1) on both sides (the runner's rule), so both
train on the same batches, step by step.

Measurements, each side in its own fresh process (so that its peak is its own), the sides
interleaved (--rounds rounds, the order alternating): --warmup steps (default 2), then --reps
timed steps (default 5; 3 for "long"); per side the median and the min of all timed steps of all
rounds. tokens/s = B·T / median step time. others' CPU: how many CPUs other processes kept busy,
on average, while a side's processes ran (attention_peer.OthersCpu: /proc/stat's busy time less
this script's and its children's); timings are only as good as the machine is quiet, and on a
2-core machine 1.0 there can halve either side's speed. peak RSS: the process's ru_maxrss (VmHWM) at the
end: everything it ever held resident, the runtime included (libtorch's code and its allocator
caches; ours is a small static binary). "growth" is peak RSS minus the RSS just before the model
is built (after the runtime, the data and the thread pool exist): the step's own memory, weights,
gradients and optimizer state included. ours alloc: the budget allocator's measured peak of
requested bytes (= the plan's predicted peak; both printed).

--check: the runner dumps its initial weights (model::init_weights, seed 1) and one more PyTorch
process loads them, so both sides start from the same bits; the table then also prints every
step's loss from both sides and their largest difference. Step 1 is the same function of the
same inputs (fp32 on both sides, different summation orders): |Δ| should be ~1e-6; exit status 1
when it exceeds 1e-4. Later steps add AdamW's updates, whose size is lr·g/(|g| + eps) ≈ ±lr for
every element, so an element whose gradient is rounding noise can move the other way on the other
side; they are held to a looser bound, 1e-3 (measured at the default shape: 3.7e-7 at step 1,
5.8e-7 at most over steps 2-5, so the blocks, the tied head, the clip, the decay groups and AdamW
agree).
"""
import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DATA = os.path.join(ROOT, "examples", "data", "tinyshakespeare.txt")
MiB = float(1 << 20)
VOCAB = 256
NORM_EPS = 1e-5
STD = 0.02
NS, KCONV = 16, 4  # mamba_shape::defaults
TTT_MB = 16
BLOCK_NAMES = {"ttt": "ttt_linear", "attn": "attention", "mamba": "mamba", "ttt_mlp": "ttt_mlp"}

SHAPES = {
    "default": dict(layers="ttt,attn,mamba,attn", width=128, heads=4, seq=128, batch=8, budget="32MiB",
                    reps=5),
    "long": dict(layers="ttt,attn,mamba,attn", width=256, heads=4, seq=4096, batch=1, budget=None, reps=3),
}
STEP1_TOL = 1e-4
LATER_TOL = 1e-3


def splitmix64(z):
    m = (1 << 64) - 1
    z = (z + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def cosine_lr(step, peak=3e-3, min_lr=3e-4, warmup=30, total=200):
    """trainer's cosine_lr (train/schedule_lr.hpp) at 0-based step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if total <= warmup or step >= total:
        return min_lr
    t = (step - warmup) / (total - warmup)
    return min_lr + 0.5 * (peak - min_lr) * (1.0 + math.cos(math.pi * t))


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# ---- The parameter table: mixer_traits.hpp's params(), in its order ----------------------------
def mlp_hidden(C):
    return (8 * C // 3 + 7) // 8 * 8


def block_spec(kind, C, H):
    """[(name, shape, init)] of one block, init: ("normal", std) | ("const", v) | "a_log" | "dt_bias"."""
    D = C // H
    n = ("normal", STD)
    spec = [("norm1", (C,), ("const", 1.0))]
    if kind == "attention":
        spec += [("wq", (C, C), n), ("wk", (C, C), n), ("wv", (C, C), n), ("wo", (C, C), n)]
    elif kind == "mamba":
        Di, R = 2 * C, (C + 15) // 16
        spec += [("in_proj", (C, 2 * Di), n), ("conv_w", (Di, KCONV), ("normal", 1 / math.sqrt(3 * KCONV))),
                 ("conv_b", (Di,), ("const", 0.0)), ("x_proj", (Di, R + 2 * NS), n),
                 ("dt_proj", (R, Di), ("normal", 1 / math.sqrt(R) / math.sqrt(3))), ("dt_bias", (Di,), "dt_bias"),
                 ("a_log", (Di, NS), "a_log"), ("d", (Di,), ("const", 1.0)), ("out_proj", (Di, C), n)]
    else:  # ttt_linear / ttt_mlp (no gate: wg has no elements)
        Fh = 4 * D if kind == "ttt_mlp" else D
        spec += [("wq", (C, C), n), ("wk", (C, C), n), ("wv", (C, C), n), ("ttt_norm_w", (H, D), ("const", 1.0)),
                 ("ttt_norm_b", (H, D), ("const", 0.0)), ("w1", (H, D, Fh), n), ("b1", (H, Fh), ("const", 0.0)),
                 ("lr_w", (H, C), n), ("lr_b", (H,), ("const", 0.0)), ("tok_offset", (TTT_MB,), ("const", 0.0)),
                 ("post_w", (C,), ("const", 1.0)), ("post_b", (C,), ("const", 0.0)), ("wo", (C, C), n)]
        if kind == "ttt_mlp":
            spec += [("w2", (H, Fh, D), n), ("b2", (H, D), ("const", 0.0))]
    F_ = mlp_hidden(C)
    spec += [("norm2", (C,), ("const", 1.0)), ("w_gate", (C, F_), n), ("w_up", (C, F_), n),
             ("w_down", (F_, C), n)]
    return spec


def model_spec(blocks, C, H):
    spec = [("embedding", (VOCAB, C), ("normal", STD))]
    for i, kind in enumerate(blocks):
        spec += [(f"blocks.{i}.{kind}.{n}", s, init) for n, s, init in block_spec(kind, C, H)]
    spec.append(("final_norm", (C,), ("const", 1.0)))
    return spec


def init_weights(torch, spec, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = {}
    for name, shape, init in spec:
        if init == "a_log":  # log(1 + j) for state j: A = -(1 .. Ns)
            t = torch.log(torch.arange(1, shape[1] + 1, dtype=torch.float64)).expand(shape).clone()
        elif init == "dt_bias":  # softplus^-1(dt), dt log-uniform in [1e-3, 0.1]
            lo, hi = math.log(1e-3), math.log(0.1)
            dt = torch.exp(lo + (hi - lo) * torch.rand(shape, generator=g, dtype=torch.float64)).clamp_min(1e-4)
            t = dt + torch.log(-torch.expm1(-dt))
        elif init[0] == "const":
            t = torch.full(shape, init[1], dtype=torch.float64)
        else:
            t = torch.randn(shape, generator=g, dtype=torch.float64) * init[1]
        w[name] = t.float()
    return w


def load_weights(torch, spec, path, table):
    flat = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.float32)
    at = {e[0]: (e[1], e[2]) for e in table}
    w = {}
    for name, shape, _ in spec:
        off, count = at[name]
        if count != math.prod(shape):
            raise RuntimeError(f"{name}: ours has {count} elements, this script expects {shape}")
        w[name] = flat[off:off + count].reshape(shape).clone()
    return w


# ---- The PyTorch model ---------------------------------------------------------------------------
def build_model(torch, blocks, C, H, T, w, fast=False, compile_step=True):
    """The PyTorch model; fast: its mixers as fast_mixers.py runs them (the same model), TTT's
    mini-batch step compiled unless compile_step is False."""
    import torch.nn as nn
    import torch.nn.functional as F
    sys.path.insert(0, HERE)
    import attention_peer as AP
    import mamba_peer as MP
    import ttt_peer as TP
    mamba_class, ttt_class = MP.TorchMamba, TP.TorchTTT
    if fast:
        import fast_mixers as FM
        mamba_class = FM.FastMamba
        ttt_class = lambda *a, **k: FM.FastTTT(*a, compile_step=compile_step, **k)  # noqa: E731
    # The per-layer peers hold their shapes as module constants: set them for this process's shape.
    AP.H = AP.HKV = H
    TP.H, TP.C, TP.D = H, C, C // H
    assert TP.MB == TTT_MB
    D = C // H
    Fh = mlp_hidden(C)

    def linear(w_in_out):
        lin = nn.Linear(w_in_out.shape[0], w_in_out.shape[1], bias=False)
        with torch.no_grad():
            lin.weight.copy_(w_in_out.T)
        return lin

    class Block(nn.Module):
        def __init__(self, i, kind):
            super().__init__()
            p = lambda n: w[f"blocks.{i}.{kind}.{n}"]  # noqa: E731
            self.norm1 = nn.Parameter(p("norm1").clone())
            if kind == "attention":
                self.mixer = AP.TorchAttention({n: p(n) for n in ("wq", "wk", "wv", "wo")}, T, D, torch.float32,
                                               requires_grad=True)
            elif kind == "mamba":
                self.mixer = mamba_class({n: p(n) for n in MP.WEIGHTS}, C, torch.float32, requires_grad=True)
            else:
                names = [n for n, _, _ in block_spec(kind, C, H)[1:-4]]
                self.mixer = ttt_class({n: p(n) for n in names}, torch.float32, 0,
                                       "mlp" if kind == "ttt_mlp" else "linear")
            self.norm2 = nn.Parameter(p("norm2").clone())
            self.w_gate, self.w_up, self.w_down = linear(p("w_gate")), linear(p("w_up")), linear(p("w_down"))

        def forward(self, x):
            h = x + self.mixer(F.rms_norm(x, (C,), self.norm1, NORM_EPS))
            n = F.rms_norm(h, (C,), self.norm2, NORM_EPS)
            return h + self.w_down(F.silu(self.w_gate(n)) * self.w_up(n))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Parameter(w["embedding"].clone())
            self.blocks = nn.ModuleList([Block(i, k) for i, k in enumerate(blocks)])
            self.final_norm = nn.Parameter(w["final_norm"].clone())

        def forward(self, x, y):
            h = F.embedding(x, self.embedding)
            for b in self.blocks:
                h = b(h)
            logits = F.rms_norm(h, (C,), self.final_norm, NORM_EPS) @ self.embedding.T  # tied head
            return F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))

    m = Model()
    m.train()
    return m


# Ours decays exactly the tensors drawn N(0, σ²): these, by their PyTorch names.
DECAYED = ("embedding", "wq.weight", "wk.weight", "wv.weight", "wo.weight", "q_proj.weight", "k_proj.weight",
           "v_proj.weight", "o_proj.weight", "learnable_ttt_lr_weight", "W1", "W2", "in_proj.weight",
           "conv1d.weight", "x_proj.weight", "dt_proj.weight", "out_proj.weight", "w_gate.weight",
           "w_up.weight", "w_down.weight")


def torch_child(args):
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    torch.set_num_threads(args.threads)
    blocks = [BLOCK_NAMES[b] for b in args.layers.split(",")]
    C, H, T, B = args.width, args.heads, args.seq, args.batch
    raw = open(args.data, "rb").read()
    text = torch.frombuffer(bytearray(raw[: len(raw) * 9 // 10]), dtype=torch.uint8).to(torch.int64)
    n = text.numel()
    baseline = rss_bytes()

    spec = model_spec(blocks, C, H)
    if args.load_weights:
        table = json.load(open(args.load_weights + ".json"))["weights_table"]
        w = load_weights(torch, spec, args.load_weights, table)
    else:
        w = init_weights(torch, spec)
    model = build_model(torch, blocks, C, H, T, w)
    del w
    decay = [p for nm, p in model.named_parameters() if nm.endswith(DECAYED)]
    other = [p for nm, p in model.named_parameters() if not nm.endswith(DECAYED)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=cosine_lr(0), betas=(0.9, 0.95), eps=1e-8)
    params = list(model.parameters())

    ms, losses = [], []
    for step in range(args.warmup + args.reps):
        t0 = time.perf_counter()
        at = [splitmix64(step * B + j) % (n - T - 1) for j in range(B)]
        x = torch.stack([text[a:a + T] for a in at])
        y = torch.stack([text[a + 1:a + T + 1] for a in at])
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step)
        opt.step()
        dt = (time.perf_counter() - t0) * 1e3
        losses.append(loss.item())
        if step >= args.warmup:
            ms.append(dt)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"side": "torch", "ms": ms, "losses": losses, "tokens_per_step": B * T,
                      "params": sum(p.numel() for p in params), "baseline_rss_bytes": baseline,
                      "peak_rss_bytes": peak, "threads": torch.get_num_threads(),
                      "torch": torch.__version__}))


# ---- The driver ------------------------------------------------------------------------------------
def shape_args(sh, warmup, reps):
    return ["--layers", sh["layers"], "--width", str(sh["width"]), "--heads", str(sh["heads"]),
            "--seq", str(sh["seq"]), "--batch", str(sh["batch"]), "--warmup", str(warmup), "--reps", str(reps)]


def run_json(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def torch_env():
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see ttt_peer.py: spinning OpenMP workers on a shared machine
    return env


def run_shape(label, sh, args):
    reps = args.reps or sh["reps"]
    common = shape_args(sh, args.warmup, reps) + ["--threads", str(args.threads), "--data", args.data]
    ours_cmd = [args.ours] + common + ["--budget", sh["budget"]]
    torch_cmd = [sys.executable, os.path.abspath(__file__), "--torch-child"] + common
    sys.path.insert(0, HERE)
    from attention_peer import OthersCpu
    res = {"ours": [], "torch": []}
    for r in range(args.rounds):
        order = ("ours", "torch") if r % 2 == 0 else ("torch", "ours")
        for side in order:
            others = OthersCpu()
            others.start()
            res[side].append(run_json(ours_cmd) if side == "ours" else run_json(torch_cmd, torch_env()))
            res[side][-1]["others_cpu"] = others.stop()
    check = None
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "w.bin")
            o = run_json(ours_cmd + ["--dump-weights", path])
            json.dump(o, open(path + ".json", "w"))
            t = run_json(torch_cmd + ["--load-weights", path], torch_env())
            check = (o["losses"], t["losses"])
    return res, check


def summarize(runs):
    ms = [m for r in runs for m in r["ms"]]
    return {"median": statistics.median(ms), "min": min(ms), "tok": runs[0]["tokens_per_step"],
            "peak": max(r["peak_rss_bytes"] for r in runs),
            "growth": max(r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in runs),
            "params": runs[0]["params"], "others": statistics.mean(r["others_cpu"] for r in runs)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ours", help="path of model_peer_runner")
    ap.add_argument("--shapes", default="default,long")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=0, help="timed steps per process (0: 5 default, 3 long)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--long-budget", default="256MiB")
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--check", action="store_true", help="also start both from our weights and compare losses")
    # the PyTorch child (one shape, one process)
    ap.add_argument("--torch-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--load-weights", help=argparse.SUPPRESS)
    for k in ("layers", "budget"):
        ap.add_argument("--" + k, help=argparse.SUPPRESS)
    for k in ("width", "heads", "seq", "batch"):
        ap.add_argument("--" + k, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_child:
        args.reps = args.reps or 5
        return torch_child(args)
    if not args.ours:
        ap.error("--ours PATH (model_peer_runner) is required")

    SHAPES["long"]["budget"] = args.long_budget
    print(f"model_peer: {args.threads} threads, {args.rounds} rounds (interleaved, fresh processes), "
          f"warm-up {args.warmup} steps; load average {os.getloadavg()[0]:.2f}", flush=True)
    rows, failed = [], False
    for label in args.shapes.split(","):
        sh = SHAPES[label]
        res, check = run_shape(label, sh, args)
        o, t = summarize(res["ours"]), summarize(res["torch"])
        ours0 = res["ours"][0]
        print(f"\n{label}: blocks {sh['layers']}, width {sh['width']}, {sh['heads']} heads, T = {sh['seq']}, "
              f"batch {sh['batch']}, fp32; params ours {o['params']}, torch {t['params']}"
              f"{'' if o['params'] == t['params'] else '  (DIFFER)'}; ours: plan {ours0['plan']}, budget "
              f"{sh['budget']}, measured peak {ours0['measured_peak_bytes'] / MiB:.2f} MiB = predicted "
              f"{ours0['predicted_peak_bytes'] / MiB:.2f} MiB: "
              f"{'yes' if ours0['measured_peak_bytes'] == ours0['predicted_peak_bytes'] else 'NO'}; "
              f"torch {res['torch'][0]['torch']}")
        failed |= o["params"] != t["params"]
        if check:
            ol, tl = check
            d = [abs(a - b) for a, b in zip(ol, tl)]
            print("  check (both from our initial weights): loss per step ours " +
                  " ".join(f"{v:.6f}" for v in ol) + "\n" + " " * 49 + "torch " +
                  " ".join(f"{v:.6f}" for v in tl) +
                  f"\n  |Δ| step 1 {d[0]:.2e} (bound {STEP1_TOL:g}), later steps max {max(d[1:] or [0]):.2e} "
                  f"(bound {LATER_TOL:g})")
            failed |= d[0] > STEP1_TOL or max(d[1:] or [0]) > LATER_TOL
        rows.append((label, sh, o, t))
    print("\n| shape | ours ms (median / min) | torch ms (median / min) | ours tok/s | torch tok/s | "
          "ours/torch tok/s | ours peak RSS MiB (growth) | torch peak RSS MiB (growth) | ours/torch RSS (growth) | others' CPU (ours, torch) |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for label, sh, o, t in rows:
        ot, tt = o["tok"] / (o["median"] / 1e3), t["tok"] / (t["median"] / 1e3)
        print(f"| {label} (T={sh['seq']}, C={sh['width']}, B={sh['batch']}) | {o['median']:.1f} / {o['min']:.1f} | "
              f"{t['median']:.1f} / {t['min']:.1f} | {ot:,.0f} | {tt:,.0f} | {ot / tt:.2f}x | "
              f"{o['peak'] / MiB:.1f} ({o['growth'] / MiB:.1f}) | {t['peak'] / MiB:.1f} ({t['growth'] / MiB:.1f}) | "
              f"{o['peak'] / t['peak']:.3f} ({o['growth'] / t['growth']:.3f}) | {o['others']:.2f}, {t['others']:.2f} |")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
