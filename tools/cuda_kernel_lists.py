#!/usr/bin/env python3
"""Which kernels of a check build's PTX-only units no fully compiled unit compiles.

In a check build (MEMBOUND_CHECK_BUILD, the ci preset) the programs and the data-parallel tests
compile their device code to PTX only, at cicc -O1 (CMakeLists.txt,
membound_cuda_device_checked_elsewhere): the claim is that the units compiled in full (through
ptxas, at full optimisation) instantiate the same kernels. This checks the claim: it compiles every
nvcc unit of the build to PTX (cicc -O1, fast: no host pass, no ptxas), lists each unit's kernel
entries, and prints those of the PTX-only units that no full unit has.

Usage:

    python3 tools/cuda_kernel_lists.py [BUILD_DIR]     # default build/ci; needs compile_commands.json

Exits 0 always (a report, not a test): the build's comment names the known exceptions.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def main() -> int:
    build = Path(sys.argv[1] if len(sys.argv) > 1 else "build/ci").resolve()
    db = build / "compile_commands.json"
    if not db.exists():
        sys.exit(f"cuda_kernel_lists.py: {db} not found (configure with CMAKE_EXPORT_COMPILE_COMMANDS=ON)")
    units = []
    for e in json.loads(db.read_text()):
        f = e["file"]
        if not f.endswith(".cu") or "/self_contained/" in f or "single_header" in f:
            continue
        target = re.search(r"CMakeFiles/([^/]+)\.dir", e["command"]).group(1)
        ptx_only = re.search(r"code=\[?compute_\d+\]?(\s|$)", e["command"]) is not None
        units.append((target, ptx_only, e))
    with tempfile.TemporaryDirectory(prefix="kernel_lists_") as tmp:
        def entries(unit):
            target, _, e = unit
            args = shlex.split(e["command"])
            args = args[: args.index("-c")]  # compiler, flags; the source and -o go after
            drop = {"all-warnings", "-Werror", "-Xcicc", "-O1"}  # "-Xcicc -O1": a PTX-only unit's
            args = [a for a in args[:1]] + [a for a in args[1:] if a not in drop
                                            and not a.startswith(("--generate-code", "--Werror"))]
            out = Path(tmp) / f"{target}.ptx"
            cmd = args + ["-arch=compute_90", "-Xcicc", "-O1", "--ptx", e["file"], "-o", str(out)]
            r = subprocess.run(cmd, cwd=e["directory"], capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"cuda_kernel_lists.py: {target} did not compile to PTX:\n{r.stderr}")
            return set(re.findall(r"\.entry\s+([A-Za-z0-9_$]+)", out.read_text()))

        with ThreadPoolExecutor(max_workers=2) as pool:
            lists = list(pool.map(entries, units))
    full = set().union(*(k for (t, p, _), k in zip(units, lists) if not p))
    print(f"{sum(not p for _, p, _ in units)} units compiled in full, {len(full)} kernels")
    for (target, ptx_only, _), kernels in zip(units, lists):
        if not ptx_only:
            continue
        missing = sorted(kernels - full)
        print(f"{target} (PTX only): {len(kernels)} kernels, {len(missing)} compiled by no full unit")
        if missing:
            names = subprocess.run(["c++filt"], input="\n".join(missing), capture_output=True,
                                   text=True).stdout.splitlines()
            for n in names:
                print(f"    {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
