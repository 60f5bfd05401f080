#!/usr/bin/env python3
"""The Mamba block's device kernels emulated on the host, against the CPU layer (no GPU needed).

Cuts the kernels (and the chunk sizes the launchers share with them) out of include/membound/
backend/cuda/mamba_cuda.cuh between fixed markers, compiles them with tools/mamba_cuda_emulate.cpp
as plain C++ (g++, -fsanitize=thread by default) and runs the result with the launchers' channels
per CTA and with fewer. It checks the chunk-parallel forward scan (chunk-local states, the combine
over chunks, every chunk from its entry state), the chunk-parallel reverse scan (chunk-local
dL/dh, the carry over chunks, every chunk from its carried dL/dh on states recomputed from
shared-memory checkpoints, also in runs of several tiles) and the reductions: index arithmetic,
barriers (a missing one is a data race under TSan), and the results against cpu_backend in fp32
(out, the saved states, dx, the nine gradients), at T not a multiple of the chunk, T < chunk, one
and several chunks, chunks of up to 125 tiles, B = 2, d_state 1, 2, 4, 5 and 16; and that y and
every output do not depend on the checkpoint policy. --sanitize address runs it under ASan and UBSan
instead: every buffer is sized exactly as the launchers size it, so a kernel that indexes past
its buffer shows. It does not replace a GPU run (see the .cpp's header). Usage:

    python3 tools/mamba_cuda_emulate.py [--cpb 0 3 1] [--sanitize thread|address|none] [-v]

(--cpb 0: the launchers' channels per CTA.) Exits 0 when every run passes, 1 otherwise.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "include/membound/backend/cuda/mamba_cuda.cuh"
CONSTS = ("inline constexpr std::size_t mamba_scan_channels", "}  // namespace gpu")
KERNELS = ("// v rounded through storage S", "inline unsigned grid_for(")


def cut(text: str, start: str, end: str) -> str:
    a = text.index(start)
    b = text.index(end, a)
    return text[a:b]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpb", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--sanitize", choices=("thread", "address", "none"), default="thread")
    ap.add_argument("--header", type=Path, default=HEADER,
                    help="the header to cut the kernels from (a modified copy, say)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every case's report")
    args = ap.parse_args()
    text = args.header.read_text()
    cxx = shutil.which("g++") or sys.exit("mamba_cuda_emulate.py: g++ not found")
    with tempfile.TemporaryDirectory(prefix="mamba_emu_") as tmp:
        d = Path(tmp)
        (d / "consts.inc").write_text(cut(text, *CONSTS))
        (d / "kernels.inc").write_text(cut(text, *KERNELS))
        exe = d / "emu"
        flags = {"thread": ["-O1", "-g", "-fsanitize=thread"],
                 "address": ["-O1", "-g", "-fsanitize=address,undefined",
                             "-fno-sanitize-recover=all"],
                 "none": ["-O2"]}[args.sanitize]
        cmd = [cxx, "-std=c++20", *flags, "-w", "-I", str(d), "-I", str(ROOT / "include"),
               "-isystem", "/usr/include/eigen3", str(ROOT / "tools/mamba_cuda_emulate.cpp"),
               "-o", str(exe)]
        if subprocess.run(cmd).returncode != 0:
            print("mamba_cuda_emulate.py: the emulation did not compile", file=sys.stderr)
            return 1
        ok = True
        for cpb in args.cpb:
            res = subprocess.run([str(exe), str(cpb)], capture_output=True, text=True)
            out = res.stdout + res.stderr
            races = out.count("WARNING: ThreadSanitizer")
            what = "the launchers' channels per CTA" if cpb == 0 else f"at most {cpb} channels per CTA"
            print(out.strip().splitlines()[-1] if out.strip() else "(no output)",
                  f"[{what}, {races} TSan reports, exit {res.returncode}]")
            if res.returncode != 0 or races or args.verbose:
                print(out)
                ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
