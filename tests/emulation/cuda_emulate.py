#!/usr/bin/env python3
"""Device kernels emulated on the host, against the CPU backend (no GPU needed).

For each target, compiles the target's tests/emulation/<target>_cuda_emulate.cpp, which includes the
kernels' own text (include/membound/backend/cuda/<family>_kernels.inl and the constants and size
functions the launchers share with them, <family>_sizes.inl: the files nvcc compiles), as plain
C++ (g++, -fsanitize=thread by default, so a missing barrier is a data race; --sanitize address runs ASan and UBSan instead: every buffer has the
launchers' exact size, so a kernel that indexes past one shows) and runs the result once per
argument set. Each .cpp's header says what it checks and what it cannot; none replaces a GPU run.

  ttt        the TTT inner loop, forward, backward and the decoding step, at 32 threads per CTA
             (one warp), its tensor-core products' mma.sync emulated from the PTX ISA's fragment
             layouts: against the CPU layer in fp32 and float64 (head_dim 16, 12 and 64), bits
             across the state group, the inner loop's shared-memory placements and 64 threads
  mamba      the chunk-parallel selective scan, forward and reverse, with the launchers' channels
             per CTA and at most 3: against the CPU layer in fp32 at 13 shapes
  adamw8bit  the 8-bit AdamW step: against adamw8bit::update on the CPU, bit for bit
  model      the model's bandwidth-bound kernels (RMSNorm, the elementwise maps, the embedding
             gather, the fused cross-entropy, the norm's first pass, AdamW and its launches):
             against the CPU backend in fp32 and bf16, their 16-byte path bit-identical to their
             element path, every access inside its buffer
  moe        the mixture of experts' router, dispatch, gathers, combines, gates' and router's
             backward: against the CPU layer in fp32 (top-1/2, capacity binding or not, every
             token to one expert), the statistics exactly
  attention  the tensor-core attention kernels (mma.sync forward, dQ, dK/dV), each lane a thread
             and mma.sync emulated from the PTX ISA's fragment layouts: against a double-precision
             attention, bf16 operands at 11 shapes (3 sliding windows, 2 packed) run twice, bit-identical; fp16 at
             the 6 full-attention shapes once

Usage:

    python3 tests/emulation/cuda_emulate.py [ttt|mamba|adamw8bit|model|moe|attention ...] [--args A B ...]
                                  [--sanitize thread|address|none] [-v]

No target: all of them. --args replaces the target's argument sets (one argv[1] each). Exits 0
when every run passes, 1 otherwise.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# argument sets and what one argument means
TARGETS = {
    "ttt": dict(
        args=[""],
        label=lambda a: "32 threads per CTA, then 64"),
    "mamba": dict(
        args=["0", "3"],
        label=lambda a: "the launchers' channels per CTA" if a == "0" else f"at most {a} channels per CTA"),
    "adamw8bit": dict(
        args=[""],
        label=lambda a: "one run"),
    "model": dict(
        args=[""],
        label=lambda a: "one run"),
    "moe": dict(
        args=[""],
        label=lambda a: "one run"),
    "attention": dict(
        args=["bf16", "fp16"],
        label=lambda a: f"{a} operands"),
}

# -g1: line tables, all a sanitizer's report prints, and a third less compile time than -g.
FLAGS = {"thread": ["-O1", "-g1", "-fsanitize=thread"],
         "address": ["-O1", "-g1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
         "none": ["-O2"]}


def run_target(name: str, args: argparse.Namespace, cxx: str) -> bool:
    t = TARGETS[name]
    with tempfile.TemporaryDirectory(prefix=f"{name}_emu_") as tmp:
        d = Path(tmp)
        exe = d / "emu"
        cmd = [cxx, "-std=c++20", *FLAGS[args.sanitize], "-w", "-I", str(ROOT / "include"),
               "-isystem", "/usr/include/eigen3", str(ROOT / f"tests/emulation/{name}_cuda_emulate.cpp"), "-o", str(exe)]
        if subprocess.run(cmd).returncode != 0:
            print(f"cuda_emulate.py: the {name} emulation did not compile", file=sys.stderr)
            return False
        ok = True
        for a in (args.args if args.args is not None else t["args"]):
            res = subprocess.run([str(exe)] + ([a] if a else []), capture_output=True, text=True)
            out = res.stdout + res.stderr
            races = out.count("WARNING: ThreadSanitizer")
            last = out.strip().splitlines()[-1] if out.strip() else "(no output)"
            print(f"{name}: {last} [{t['label'](a)}, {races} TSan reports, exit {res.returncode}]")
            if res.returncode != 0 or races or args.verbose:
                print(out)
            if res.returncode != 0 or races:
                ok = False
        return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("targets", nargs="*", choices=[*TARGETS, []], default=[],
                    help="what to emulate (default: all)")
    ap.add_argument("--args", nargs="+", help="the argument sets to run (replaces the target's)")
    ap.add_argument("--sanitize", choices=tuple(FLAGS), default="thread")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every run's report")
    args = ap.parse_args()
    cxx = shutil.which("g++") or sys.exit("cuda_emulate.py: g++ not found")
    ok = True
    for name in args.targets or list(TARGETS):
        ok = run_target(name, args, cxx) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
