#!/usr/bin/env python3
"""The PyTorch Mamba-1 block written as mamba_ssm's reference path (selective_scan_ref), on CUDA:
the peer of bench/bench_cuda_mamba.cu's block benchmarks, run on the same GPU. A tool to run and
report, not part of ctest. The block, its inputs and the reference scan are mamba_peer.py's (the
CPU peer, checked there against our float64 reference); only the device differs.

    python3 bench/peers/mamba_cuda_peer.py                      # T in 1k, 4k; C in 768, 2048
    python3 bench/peers/mamba_cuda_peer.py --T 1024 4096 16384 65536 --reps 3
    build/release/bench/bench_cuda_mamba --benchmark_filter='bm_forward|bm_forward_backward'

Columns, per (T, C), bf16 (the block holds bf16 parameters; its scan is fp32, as upstream's):
  fwd ms, fwdbwd ms   best of --reps CUDA-event timings of one call after one warm-up ("fwd"
                      under torch.no_grad(), its best case; "fwdbwd" out = block(x);
                      out.backward(dy)).
  tokens/s            T / time: compare with bench_cuda_mamba's tokens/s counters.
  peak MiB            torch.cuda.max_memory_allocated() growth over one call, from a reset, minus
                      what existed before (inputs, weights): compare with the benchmark's
                      saved_MiB + workspace_MiB (the issue's target: ours ≤ a tenth of this).
Shapes whose reference run does not fit in memory are reported as "OOM".
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mamba_peer import TorchMamba, make_inputs, torch_call  # noqa: E402


def timed(fn, reps):
    best = float("inf")
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(stop))
    return best


def run(T, C, bwd, reps):
    inputs = make_inputs(T, C)
    dev = torch.device("cuda")
    w = {k: v.to(dev) for k, v in inputs.items()}
    block = TorchMamba(w, C, torch.bfloat16, requires_grad=bwd).to(dev)
    x = w["x"].to(torch.bfloat16).view(1, T, C).requires_grad_(bwd)
    dy = w["dy"].to(torch.bfloat16).view(1, T, C)
    call = lambda: torch_call(block, x, dy, bwd)  # noqa: E731
    call()  # warm-up
    torch.cuda.synchronize()
    ms = timed(call, reps)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del block, x, dy, w
    torch.cuda.empty_cache()
    return ms, peak


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--C", type=int, nargs="+", default=[768, 2048])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("mamba_cuda_peer.py: no CUDA device")
        return 77
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'T':>6} {'C':>5} {'pass':>7} {'ms':>10} {'tokens/s':>12} {'peak MiB':>10}")
    for C in args.C:
        for T in args.T:
            for bwd in (False, True):
                name = "fwdbwd" if bwd else "fwd"
                try:
                    ms, peak = run(T, C, bwd, args.reps)
                    print(f"{T:>6} {C:>5} {name:>7} {ms:>10.2f} {T / ms * 1e3:>12.0f} "
                          f"{peak / (1 << 20):>10.1f}", flush=True)
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    print(f"{T:>6} {C:>5} {name:>7} {'OOM':>10}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
