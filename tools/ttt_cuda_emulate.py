#!/usr/bin/env python3
"""The TTT layers' device kernels emulated on the host, against the CPU layer (no GPU needed).

Cuts the kernels (and the scratch-size functions) out of include/membound/backend/cuda/
ttt_cuda.cuh between fixed markers, compiles them with tools/ttt_cuda_emulate.cpp as plain C++
(g++, -fsanitize=thread by default) and runs the result with a few threads-per-CTA counts. It
checks the kernels' index arithmetic, their phase barriers (a missing one is a data race under
TSan) and the backward's algorithm against cpu_backend in fp32, and that the outputs do not
depend on the checkpoint group G. --sanitize address runs it under ASan and UBSan instead: the
scratch and partial buffers are sized exactly as the launchers size them, so a kernel that carves
past its (batch, head)'s share shows on the last one. It does not replace a GPU run (see the
.cpp's header). Usage:

    python3 tools/ttt_cuda_emulate.py [--threads 1 5 32] [--sanitize thread|address|none]

Exits 0 when every run passes, 1 otherwise.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "include/membound/backend/cuda/ttt_cuda.cuh"
CONSTS = ("constexpr std::size_t ttt_step_elements(", "inline constexpr unsigned ttt_inner_threads")
KERNELS = ("// RoPE on interleaved pairs", "inline unsigned blocks_for(")


def cut(text: str, start: str, end: str) -> str:
    a = text.index(start)
    b = text.index(end, a)
    return text[a:b]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 5, 32])
    ap.add_argument("--sanitize", choices=("thread", "address", "none"), default="thread")
    args = ap.parse_args()
    text = HEADER.read_text()
    cxx = shutil.which("g++") or sys.exit("ttt_cuda_emulate.py: g++ not found")
    with tempfile.TemporaryDirectory(prefix="ttt_emu_") as tmp:
        d = Path(tmp)
        (d / "consts.inc").write_text(cut(text, *CONSTS))
        (d / "kernels.inc").write_text(cut(text, *KERNELS))
        exe = d / "emu"
        flags = {"thread": ["-O1", "-g", "-fsanitize=thread"],
                 "address": ["-O1", "-g", "-fsanitize=address,undefined",
                             "-fno-sanitize-recover=all"],
                 "none": ["-O2"]}[args.sanitize]
        cmd = [cxx, "-std=c++20", *flags, "-w", "-I", str(d), "-I", str(ROOT / "include"),
               "-isystem", "/usr/include/eigen3", str(ROOT / "tools/ttt_cuda_emulate.cpp"),
               "-o", str(exe)]
        if subprocess.run(cmd).returncode != 0:
            print("ttt_cuda_emulate.py: the emulation did not compile", file=sys.stderr)
            return 1
        ok = True
        for nt in args.threads:
            res = subprocess.run([str(exe), str(nt)], capture_output=True, text=True)
            out = res.stdout + res.stderr
            races = out.count("WARNING: ThreadSanitizer")
            print(out.strip().splitlines()[-1] if out.strip() else "(no output)",
                  f"[{nt} threads per CTA, {races} TSan reports, exit {res.returncode}]")
            if res.returncode != 0 or races:
                print(out)
                ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
