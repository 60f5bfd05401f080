#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the GPU, flash and cuDNN backends, on the shapes of
bench/bench_cuda_attention.cu (B·T = 16384 tokens, H = 16, D in {64, 128}, causal and full,
T = 512 ... 16384), with the same FLOP count: 4·B·H·T²·D forward, halved when causal; backward
2.5x forward. Prints one line per (backend, D, causal, T): forward and forward+backward TFLOP/s and
the peak memory PyTorch allocated. Run it on the GPU machine next to bench_cuda_attention:

    python3 bench/peers/sdpa_peer.py [--dtype bf16|fp16] [--reps 20] [--seqs 2048 8192]

A tool to run and report, not part of ctest.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def flops(b: int, h: int, t: int, d: int, causal: bool, backward: bool) -> float:
    f = 4.0 * b * h * t * t * d * (0.5 if causal else 1.0)
    return f * 3.5 if backward else f


def timed(fn, reps: int) -> float:
    fn()  # warm-up
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seqs", type=int, nargs="+", help="only these T (default 512 ... 16384)")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    h = 16
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    print("backend,D,causal,T,fwd_TFLOP/s,fwdbwd_TFLOP/s,peak_MiB")
    for name, backend in backends.items():
        for d in (64, 128):
            for causal in (True, False):
                for t in args.seqs or [512 << i for i in range(6)]:
                    b = max(1, 16384 // t)
                    q, k, v, do = (torch.randn(b, h, t, d, device="cuda", dtype=dtype)
                                   for _ in range(4))
                    for x in (q, k, v):
                        x.requires_grad_(True)
                    try:
                        with sdpa_kernel(backend):
                            def fwd():
                                with torch.no_grad():
                                    F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                            def fwdbwd():
                                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                                o.backward(do)

                            torch.cuda.reset_peak_memory_stats()
                            tf = timed(fwd, args.reps)
                            tb = timed(fwdbwd, args.reps)
                            peak = torch.cuda.max_memory_allocated() / 2**20
                        print(f"{name},{d},{int(causal)},{t},"
                              f"{flops(b, h, t, d, causal, False) / tf / 1e12:.1f},"
                              f"{flops(b, h, t, d, causal, True) / tb / 1e12:.1f},{peak:.0f}")
                    except RuntimeError as e:  # a backend that refuses the shape or device
                        print(f"{name},{d},{int(causal)},{t},n/a,n/a,n/a  # {str(e).splitlines()[0]}")


if __name__ == "__main__":
    main()
