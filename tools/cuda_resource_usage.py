#!/usr/bin/env python3
"""Registers, stack, spills, shared memory and barriers of every membound kernel, per architecture.

Compiles each GPU test and benchmark translation unit (they instantiate the kernels the library
ships) to a cubin with `nvcc --resource-usage` and tabulates what ptxas reports. Needs nvcc, no
GPU: it is the part of a kernel review that costs no device time (a spill or a 255-register kernel
shows here before any run). Usage:

    python3 tools/cuda_resource_usage.py [--arch 80 --arch 90] [--markdown out.md] [files...]

Exits 1 when nvcc fails, and 2 when a kernel spills (use --allow-spills to only report them).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ENTRY = re.compile(r"Compiling entry function '([^']+)' for 'sm_(\d+)'")
PROPS = re.compile(r"Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
CUMULATIVE = re.compile(r"(\d+) bytes cumulative stack size")
USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")


def find_nvcc() -> str:
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    sys.exit("cuda_resource_usage.py: nvcc not found (looked at $CUDACXX, PATH, /usr/local/cuda/bin)")


def eigen_include() -> list[str]:
    for d in (os.environ.get("EIGEN3_INCLUDE_DIR"), "/usr/include/eigen3"):
        if d and Path(d, "Eigen").exists():
            return ["-isystem", d]
    return []


def demangle(names: list[str]) -> dict[str, str]:
    if not names or not shutil.which("c++filt"):
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    return dict(zip(names, out.splitlines()))


def short(name: str, width: int = 90) -> str:
    # Template arguments make names unreadable in a table: keep the head and the element types.
    name = name.replace("membound::", "").replace("__nv_bfloat16", "bf16")
    return name if len(name) <= width else name[: width - 3] + "..."


def compile_one(nvcc: str, src: Path, arch: str) -> tuple[list[dict], str]:
    cmd = [nvcc, "-std=c++20", f"-arch=sm_{arch}", "--resource-usage", "-cubin", "-o", os.devnull,
           "--expt-relaxed-constexpr", "-I", str(ROOT / "include"), "-I", str(ROOT / "tests"),
           *eigen_include(), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        return [], res.stderr
    # ptxas prints each entry's "Function properties" and then those of the __noinline__ functions
    # it calls: a frame line belongs to the function named just before it (a callee's 0-byte frame
    # once overwrote its kernel's 176). The stack column is the entry's cumulative stack size, its
    # callees' frames included.
    kernels, cur, props = [], None, None
    for line in res.stderr.splitlines():
        if m := ENTRY.search(line):
            cur = {"name": m.group(1), "arch": m.group(2), "src": src.name, "regs": 0, "stack": 0,
                   "spill_st": 0, "spill_ld": 0, "smem": 0, "barriers": 0}
            kernels.append(cur)
        elif m := PROPS.search(line):
            props = m.group(1)
        elif cur and props == cur["name"] and (m := FRAME.search(line)):
            cur["stack"], cur["spill_st"], cur["spill_ld"] = map(int, m.groups())
        elif cur and (m := USED.search(line)):
            cur["regs"] = int(m.group(1))
            cur["barriers"] = int(m.group(2) or 0)
            cur["smem"] = int(m.group(3) or 0)
            if c := CUMULATIVE.search(line):
                cur["stack"] = max(cur["stack"], int(c.group(1)))
    return kernels, ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", help="SM version without sm_ (default: 80 and 90)")
    ap.add_argument("--markdown", help="also write the table to this file")
    ap.add_argument("--allow-spills", action="store_true")
    ap.add_argument("files", nargs="*", type=Path)
    args = ap.parse_args()
    archs = args.arch or ["80", "90"]
    files = args.files or sorted([*ROOT.glob("tests/cuda/test_*.cu"), *ROOT.glob("bench/*.cu")])
    nvcc = find_nvcc()

    rows, failed = [], False
    for src in files:
        for arch in archs:
            kernels, err = compile_one(nvcc, src, arch)
            if err:
                print(f"cuda_resource_usage.py: nvcc failed on {src} for sm_{arch}:\n{err}", file=sys.stderr)
                failed = True
            rows.extend(kernels)

    # The same instantiation appears in several translation units: one row per (kernel, arch).
    unique = {}
    for r in rows:
        unique.setdefault((r["name"], r["arch"]), r)
    rows = sorted(unique.values(), key=lambda r: (r["name"], r["arch"]))
    names = demangle([r["name"] for r in rows])

    header = "| kernel | sm | registers | stack B | spill st/ld B | static smem B | barriers |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{short(names[r['name']])}` | {r['arch']} | {r['regs']} | {r['stack']} | "
                     f"{r['spill_st']}/{r['spill_ld']} | {r['smem']} | {r['barriers']} |")
    spills = [r for r in rows if r["spill_st"] or r["spill_ld"]]
    lines.append("")
    lines.append(f"{len(rows)} kernel instantiations from {len(files)} files; "
                 f"{len(spills)} spill; max registers {max((r['regs'] for r in rows), default=0)}")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if failed:
        return 1
    if spills and not args.allow_spills:
        print("cuda_resource_usage.py: kernels spill to local memory (see above); "
              "cut live registers or pass --allow-spills to only report", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
