#!/usr/bin/env python3
"""One training micro-batch (forward, loss, backward) of the hybrid model on the GPU: ours
(bench/bench_cuda_model.cu, model<..., cuda_backend>::forward_backward under fit()'s plan for an
8 GiB budget) against the same model written in PyTorch, on the same GPU, each shape in its own
process. A tool to run and report, not part of ctest. With --optimizer the figure is a whole
optimizer step on both sides: ours is bm_train_step (membound::trainer on the device: the
micro-batch, the gradient norm, clipping at 1 and AdamW with fp32 masters), PyTorch's adds
clip_grad_norm_(1.0) and a fused torch.optim.AdamW step on its fp32 parameters.

    cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90-real
    ninja -C build/gpu bench_cuda_model
    python3 bench/peers/model_cuda_peer.py --ours build/gpu/bench/bench_cuda_model
    python3 bench/peers/model_cuda_peer.py --ours PATH --seqs 2048 8192 --optimizer
    python3 bench/peers/model_cuda_peer.py --verify --device cpu --width 64 --heads 2   # no GPU needed

The model (both sides): 12 blocks of width 768, 12 heads of 64, repeating TTT-Linear, attention,
Mamba, attention (model_peer.py's block layout: pre-norm RMSNorm mixer + SwiGLU MLP, tied head),
vocab 256, batch 1. Ours: bf16 storage, fp32 accumulation.

PyTorch, --peer honest (the default; issue 40's peer): the same model as a user would run it at its
fastest, fp32 parameters under torch.autocast("cuda", torch.bfloat16) (mixed precision with fp32
masters), the whole model under torch.compile, and the mixers of fast_mixers.py: attention through
F.scaled_dot_product_attention (--sdpa picks its backend; auto is PyTorch's choice), Mamba through
mamba_ssm's fused CUDA path (mamba_inner_fn) where mamba_ssm imports, else through one associative
scan that torch.compile lowers to a Triton kernel (which ran is printed: mamba_ssm must be built for
the machine's torch, and PyPI has only its source), TTT through ttt-lm-pytorch's dual form with its
mini-batch step compiled. A step that does not fit without is rerun with torch.utils.checkpoint
around every block (non-reentrant), as its users do, and said so; --checkpoint forces it.
`--verify` holds the honest peer to the reference peer's loss and gradients (float64, CPU).
--peer reference: the eager reference mixers (mamba_ssm's selective_scan_ref, a Python loop over
tokens; the dual form eagerly): a correctness oracle, not a speed peer; the earlier GPU logs'
"x PyTorch" figures were against it.

Columns: ms (median of --reps CUDA-event timings after --warmup steps, which include the compile),
tokens/s, and memory: ours is the budget's measured peak of requested bytes (= the plan's
prediction, both printed by the benchmark); torch is torch.cuda.max_memory_reserved() (what the
caching allocator held: what the device must have) and max_memory_allocated(), from a reset before
the timed steps, with a line per shape naming its parts (fp32 weights, gradients, AdamW's moments,
the rest: activations and workspaces). A shape whose PyTorch run does not fit is reported as OOM.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS = "ttt,attn,mamba,attn," * 3
WIDTH, HEADS = 768, 12
MiB = float(1 << 20)


def child(args):
    import torch
    if args.cap and args.device == "cuda":  # a budget for PyTorch: its allocator refuses past it
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap / torch.cuda.get_device_properties(0).total_memory))
    try:
        return child_run(args, torch)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        # Out of memory anywhere (the model's upload, a library's workspace) under the cap is the
        # answer "does not fit"; any other error is the child's failure.
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e) or "ALLOC_FAILED" in str(e):
            print(json.dumps({"oom": True}))
            return 0
        raise


def peer_model(torch, args, T, fast, dtype=None):
    """The PyTorch model on args.device: model_peer's, its mixers fast_mixers' when `fast`."""
    sys.path.insert(0, HERE)
    import model_peer as MPR
    blocks = [MPR.BLOCK_NAMES[b] for b in args.layers.strip(",").split(",")]
    C, H = args.width, args.heads
    spec = MPR.model_spec(blocks, C, H)
    w = MPR.init_weights(torch, spec)
    model = MPR.build_model(torch, blocks, C, H, T, w, fast=fast, compile_step=not args.no_compile)
    dev = args.device
    model = model.to(dev) if dtype is None else model.to(dev, dtype)
    for mod in model.modules():  # attention's RoPE tables are plain attributes, not buffers
        for name in ("cos", "sin"):
            if isinstance(getattr(mod, name, None), torch.Tensor):
                t = getattr(mod, name).to(dev)
                setattr(mod, name, t if dtype is None else t.to(dtype))
    if args.checkpoint:
        import torch.utils.checkpoint as ckpt
        for b in model.blocks:
            inner = b.forward
            b.forward = lambda x, inner=inner: ckpt.checkpoint(inner, x, use_reentrant=False)
    return model, MPR


def sdpa_context(torch, name):
    """The SDPA backend the step runs under (--sdpa); "auto" is PyTorch's own choice."""
    import contextlib
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name])


def child_run(args, torch):
    T, dev = args.seq, args.device
    honest = args.peer == "honest"
    model, MPR = peer_model(torch, args, T, honest)
    runner = torch.compile(model) if honest and not args.no_compile else model
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, MPR.VOCAB, (1, T), generator=g).to(dev)
    import fast_mixers as FM
    ran = {"peer": args.peer, "compiled": honest and not args.no_compile, "sdpa": args.sdpa,
           "checkpointed": bool(args.checkpoint),
           "mamba": FM.mamba_backend(dev) if honest else "selective_scan_ref (Python loop)",
           "ttt": "dual form, mini-batch step compiled" if honest and not args.no_compile else "dual form, eager"}
    y = torch.randint(0, MPR.VOCAB, (1, T), generator=g).to(dev)
    params = list(model.parameters())
    opt = None
    if args.optimizer:
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=(dev == "cuda"))

    def step():
        for p in params:
            p.grad = None
        with torch.autocast(dev, dtype=torch.bfloat16), sdpa_context(torch, args.sdpa):
            loss = runner(x, y)
        loss.backward()
        if opt is not None:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        return loss

    if dev == "cpu":  # --smoke: the script's own check on a machine without a GPU
        import time
        t0 = time.perf_counter()
        loss = step()
        print(json.dumps({"oom": False, "ms": [(time.perf_counter() - t0) * 1e3], "reserved": 1, "allocated": 1,
                          "loss": loss.item(), "torch": torch.__version__, "device": "cpu", **ran}))
        return 0
    # The parts a step holds besides its activations: fp32 weights, their gradients, AdamW's two
    # moments (fused AdamW keeps no more); the rest of max_memory_allocated is the step's own.
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    parts = {"weights": weight_bytes, "gradients": weight_bytes, "optimizer": 2 * weight_bytes if opt else 0}
    try:
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ms = []
        for _ in range(args.reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            stop.record()
            torch.cuda.synchronize()
            ms.append(start.elapsed_time(stop))
    except torch.OutOfMemoryError:
        print(json.dumps({"oom": True}))
        return 0
    allocated = torch.cuda.max_memory_allocated()
    parts["activations and workspaces"] = max(0, allocated - sum(parts.values()))
    print(json.dumps({"oom": False, "ms": ms, "reserved": torch.cuda.max_memory_reserved(),
                      "allocated": allocated, "parts": parts, "torch": torch.__version__,
                      "device": torch.cuda.get_device_name(), **ran}))
    return 0


def ours(path, seqs, bench, extra=()):
    """bench_cuda_model's JSON rows of one benchmark (bm_step or bm_train_step) by sequence length."""
    r = subprocess.run([path, "--benchmark_format=json", "--benchmark_min_time=0.05", f"--benchmark_filter=^{bench}/",
                        *extra], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{path} failed ({r.returncode}):\n{r.stderr}")
    rows = {}
    for b in json.loads(r.stdout)["benchmarks"]:
        T = int(b["name"].split("/")[1])
        if T in seqs:
            rows[T] = b
    return rows, r.stderr


def child_cmd(args, T, warmup, reps, checkpoint, optimizer, cap=0):
    """The command line of one PyTorch child: this script with --child and the peer's flags."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--seq", str(T), "--warmup", str(warmup),
           "--reps", str(reps), "--peer", args.peer, "--sdpa", args.sdpa, "--layers", args.layers,
           "--width", str(args.width), "--heads", str(args.heads), "--device", args.device]
    if cap:
        cmd += ["--cap", str(cap)]
    return cmd + (["--checkpoint"] if checkpoint else []) + (["--optimizer"] if optimizer else []) + \
        (["--no-compile"] if args.no_compile else [])


def torch_child(cmd, timeout):
    """The child's JSON line, or None when it outlived `timeout` seconds."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    if r.returncode != 0:
        raise SystemExit(f"torch child failed ({r.returncode}):\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def max_seq(args):
    """The longest T each side trains in the budget, B = 1, in multiples of 256."""
    import re
    budget = int(args.max_seq * (1 << 30))
    if not args.train:
        raise SystemExit("--max-seq needs --train PATH (the example trainer)")
    data = os.path.join(HERE, "..", "..", "examples", "data", "tinyshakespeare.txt")
    r = subprocess.run([args.train, "--device", "cuda", "--data", data, "--seq", "max", "--batch", "1", "--budget",
                        f"{budget}B", "--plan-only", "1"], capture_output=True, text=True)
    m = re.search(r"--seq max: (\d+) tokens", r.stdout)
    if r.returncode != 0 or not m:
        raise SystemExit(f"{args.train} --seq max failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    ours = int(m.group(1))
    print(r.stdout, flush=True)

    def step_at(T, cap):  # whole optimizer steps, as ours plans them (AdamW's moments and masters held)
        return torch_child(child_cmd(args, T, 0, 1, args.checkpoint, True, cap), args.timeout)

    # PyTorch's reserved bytes are close to affine in T (SDPA keeps no T×T matrix): two probes, a line.
    probes = [1024, 2048]
    got = [step_at(T, 0) for T in probes]
    if any(g is None or g["oom"] for g in got):
        raise SystemExit(f"PyTorch probes at {probes} failed: {got}")
    slope = (got[1]["reserved"] - got[0]["reserved"]) / (probes[1] - probes[0])
    base = got[0]["reserved"] - slope * probes[0]
    estimate = max(256, int((budget - base) / slope) // 256 * 256) if slope > 0 else 256
    print(f"PyTorch{' (checkpointed)' if args.checkpoint else ''}: reserved {got[0]['reserved'] / MiB:.1f} MiB at "
          f"T = {probes[0]}, {got[1]['reserved'] / MiB:.1f} MiB at {probes[1]}: {slope / 1024:.1f} KiB per token, "
          f"estimate T = {estimate} in {args.max_seq:g} GiB", flush=True)
    # One step at the estimate under the cap, then 5% steps up while it fits or down while it does
    # not, until the answer changes (at most 6 steps); a timeout ends the search, said as such.
    fits, oom, note = 0, 0, ""
    T = estimate
    for _ in range(6):
        t = step_at(T, budget)
        if t is None:
            note = f" (a step at T = {T} outran {args.timeout:.0f} s: the search stopped there)"
            print(f"  T = {T}: timed out", flush=True)
            break
        print(f"  T = {T}: {'OOM' if t['oom'] else 'fits (%.1f MiB reserved)' % (t['reserved'] / MiB)}", flush=True)
        if t["oom"]:
            oom = T
        else:
            fits = T
        if fits and oom:
            break
        T = (int(T * 1.05) + 255) // 256 * 256 if not oom else int(T * 0.95) // 256 * 256
        if T < 256:
            break
    torch_max = fits
    # ours is capped by the text too: train's --seq max needs T + 2 bytes of the held-out tenth.
    with open(data, "rb") as f:
        text_cap = (min(1 << 20, len(f.read()) // 10 - 2)) // 256 * 256
    if ours >= text_cap:
        note += f" (ours is capped by the data, {text_cap} tokens, not by the budget)"
    print("(both sides hold AdamW's state; ours counts its CUDA context and executor in the budget, PyTorch's cap "
          "counts only its allocator's bytes, not its context; ours is fitted under the pressure monitor's "
          "emergency line, 97% of the budget, so that its step 1 is not retried, PyTorch up to its whole cap)")
    print(f"\n| budget | ours longest T (plan) | PyTorch longest T{' (checkpointed)' if args.checkpoint else ''} | "
          "ours/PyTorch |")
    print("|--:|--:|--:|--:|")
    ratio = f"{ours / torch_max:.2f}x" if torch_max else "-"
    print(f"| {args.max_seq:g} GiB | {ours} | {torch_max or 'none found'}{' (< %d)' % oom if oom else ''} | "
          f"{ratio} |{note}", flush=True)
    return 0


def verify(args):
    """The honest peer computes the reference peer's model: loss and every gradient from the same
    float64 weights and tokens. Bound 1e-5 relative: both sides run the Mamba scan in float32
    (upstream's selective_scan_ref casts with .float(), and so does the associative scan), in
    another order; everything else is float64. A wrong term moves a gradient by far more."""
    import torch
    if args.device != "cpu":
        raise SystemExit("--verify runs on the CPU (float64, which mamba_ssm's kernels do not take): "
                         "leave --device out")
    T = args.verify_seq
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (1, T), generator=g).to(args.device)
    y = torch.randint(0, 256, (1, T), generator=g).to(args.device)
    out = {}
    for fast in (False, True):
        model, _ = peer_model(torch, args, T, fast, torch.float64)
        run = torch.compile(model) if fast and not args.no_compile else model
        loss = run(x, y)
        loss.backward()
        out[fast] = (loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()})
    import fast_mixers as FM
    (l0, g0), (l1, g1) = out[False], out[True]
    worst_name, worst = "loss", abs(l1 - l0).item() / abs(l0).item()
    for n in g0:
        e = ((g1[n] - g0[n]).abs().max() / g0[n].abs().max().clamp_min(1e-300)).item()
        if e > worst:
            worst_name, worst = n, e
    ok = worst <= 1e-5
    print(f"honest peer ({'compiled' if not args.no_compile else 'eager'}, Mamba by "
          f"{FM.mamba_backend(args.device)}) against the reference peer, float64, T = {T}, width {args.width}, "
          f"{len(g0)} gradients: loss {l1.item():.12f} vs {l0.item():.12f}; worst relative difference {worst:.2e} "
          f"({worst_name}): {'ok' if ok else 'FAIL'} (bound 1e-5: the scans are float32 on both sides)")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ours", help="path of bench_cuda_model")
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--checkpoint", action="store_true", help="torch.utils.checkpoint around every block")
    ap.add_argument("--optimizer", action="store_true",
                    help="whole optimizer steps: ours bm_train_step, torch + clip_grad_norm_ + fused AdamW")
    ap.add_argument("--attention-kernels", choices=["wmma", "mma"], default="mma",
                    help="ours: attention's mma.sync kernels (mma, the default) or its first kernels (wmma)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds each PyTorch child may take (default 300)")
    ap.add_argument("--max-seq", type=float, metavar="GIB",
                    help="instead of timing: the longest sequence (B = 1, a multiple of 256) each side trains "
                         "in GIB GiB (ours: train --seq max --plan-only 1, exact; PyTorch: its reserved bytes at "
                         "two lengths extrapolated, then one step at the estimate under that cap, stepping down "
                         "until one fits)")
    ap.add_argument("--train", help="with --max-seq: path of the example trainer (train)")
    ap.add_argument("--peer", choices=["honest", "reference"], default="honest",
                    help="honest (the default): the model as a PyTorch user runs it at its fastest (fast_mixers.py: "
                         "mamba_ssm's kernels or a compiled associative scan, TTT's dual form with a compiled "
                         "mini-batch step, SDPA, the whole model under torch.compile, per-block checkpointing only "
                         "where a step does not fit without); reference: the eager reference mixers (Python loops: "
                         "a correctness oracle, never a speed peer)")
    ap.add_argument("--no-compile", action="store_true", help="the honest peer without torch.compile")
    ap.add_argument("--sdpa", choices=["auto", "flash", "cudnn", "efficient", "math"], default="auto",
                    help="the SDPA backend PyTorch's attention runs (auto: PyTorch's choice)")
    ap.add_argument("--layers", default=LAYERS, help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, default=WIDTH, help=argparse.SUPPRESS)
    ap.add_argument("--heads", type=int, default=HEADS, help=argparse.SUPPRESS)
    ap.add_argument("--verify", action="store_true",
                    help="instead of timing: the honest peer's loss and gradients against the reference peer's, "
                         "same weights, float64, on the CPU, at --verify-seq tokens and a "
                         "small width; exits 1 past 1e-5 relative (the Mamba scans run in float32 on both sides)")
    ap.add_argument("--verify-seq", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cap", type=int, default=0, help=argparse.SUPPRESS)  # bytes PyTorch may reserve
    ap.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--device", help=argparse.SUPPRESS)  # cuda, or cpu: --verify's, and the child's smoke test
    args = ap.parse_args()
    if args.device is None:
        args.device = "cpu" if args.verify else "cuda"
    if args.child:
        return child(args)
    if args.verify:
        return verify(args)
    if args.max_seq is not None:
        return max_seq(args)
    if not args.ours:
        ap.error("--ours PATH (bench_cuda_model) is required")
    mine, plans = ours(args.ours, set(args.seqs), "bm_train_step" if args.optimizer else "bm_step",
                       [f"--attention-kernels={args.attention_kernels}"])
    print(plans)
    ran = {int(r.get("attention_mma", 0)) for r in mine.values()}
    print(f"ours: --attention-kernels {args.attention_kernels}; ran: {'mma' if ran == {1} else 'wmma'}")
    print(f"| T | ours ms | torch ms{' (checkpointed)' if args.checkpoint else ''} | ours tok/s | torch tok/s | "
          "ours/torch tok/s | ours peak MiB (measured = predicted) | torch reserved MiB (allocated) | "
          "ours/torch memory |")
    print("|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for T in args.seqs:
        t = torch_child(child_cmd(args, T, args.warmup, args.reps, args.checkpoint, args.optimizer), args.timeout)
        if t is not None and t["oom"] and not args.checkpoint and args.peer == "honest":
            # As its users do: per-block activation checkpointing where the step does not fit without.
            t = torch_child(child_cmd(args, T, args.warmup, args.reps, True, args.optimizer), args.timeout)
        if t is not None and not t["oom"]:
            print(f"T = {T}, PyTorch ran: " + json.dumps({k: t.get(k) for k in (
                "peer", "compiled", "sdpa", "mamba", "ttt", "checkpointed", "parts", "torch", "device")}), flush=True)
        o = mine.get(T)
        if t is None:
            print(f"| {T} | {o['real_time'] if o else float('nan'):.2f} | timed out after {args.timeout:.0f} s | "
                  "- | - | - | - | - | - |", flush=True)
            continue
        o_ms = o["real_time"] if o else float("nan")
        o_tok = T / (o_ms / 1e3) if o else float("nan")
        o_mem = o["measured_peak_MiB"] if o else float("nan")
        eq = "yes" if o and o["measured_eq_predicted"] == 1 else "NO"
        if t["oom"]:
            print(f"| {T} | {o_ms:.2f} | OOM | {o_tok:,.0f} | - | - | {o_mem:.1f} ({eq}) | OOM | - |", flush=True)
            continue
        t_ms = statistics.median(t["ms"])
        t_tok = T / (t_ms / 1e3)
        print(f"| {T} | {o_ms:.2f} | {t_ms:.2f} | {o_tok:,.0f} | {t_tok:,.0f} | {o_tok / t_tok:.2f}x | "
              f"{o_mem:.1f} ({eq}) | {t['reserved'] / MiB:.1f} ({t['allocated'] / MiB:.1f}) | "
              f"{o_mem * MiB / t['reserved']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
