#!/usr/bin/env python3
"""Where a program's GPU time goes, by kernel: reads Nsight Compute's CSV of one duration metric
per launch and prints the kernels by total time, with launch counts and shares.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv PROGRAM ARGS > k.csv
    python3 tools/kernel_breakdown.py k.csv [--top 30]

Kernel names are shortened to the function's name without template arguments or parameters
(`membound::gpu::detail::ttt_forward_kernel<true, bf16>(...)` -> `ttt_forward_kernel`), so the
launches of one kernel template add up. tools/gpu_session.sh's `profile` step writes the CSV.
"""
import argparse
import csv
import io
import re
import sys

UNITS = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3,
         "second": 1.0, "s": 1.0}


def short_name(name):
    """The function's own name: template arguments and parameters dropped, namespaces too."""
    depth, out = 0, []
    for ch in name:  # drop <...> and (...) with their nesting
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    base = "".join(out).strip()
    base = base.split(" ")[-1] if " " in base else base  # a leading return type: "void f"
    return base.split("::")[-1] or name


def read(text):
    """{kernel: [seconds per launch]} from ncu's CSV (its leading ==PROF== lines skipped)."""
    lines = [l for l in text.splitlines() if l.startswith('"')]
    if not lines:
        raise SystemExit("kernel_breakdown.py: no CSV rows (was ncu run with --csv and a metric?)")
    rows = csv.DictReader(io.StringIO("\n".join(lines)))
    need = {"Kernel Name", "Metric Name", "Metric Unit", "Metric Value"}
    if not need <= set(rows.fieldnames or []):
        raise SystemExit(f"kernel_breakdown.py: expected the columns {sorted(need)}, got {rows.fieldnames}")
    times = {}
    for r in rows:
        if r["Metric Name"] != "gpu__time_duration.sum":
            continue
        unit = UNITS.get(r["Metric Unit"].strip())
        if unit is None:
            raise SystemExit(f"kernel_breakdown.py: unknown unit {r['Metric Unit']!r}")
        value = float(r["Metric Value"].replace(",", ""))
        times.setdefault(short_name(r["Kernel Name"]), []).append(value * unit)
    if not times:
        raise SystemExit("kernel_breakdown.py: no gpu__time_duration.sum rows")
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --csv output ('-': standard input)")
    ap.add_argument("--top", type=int, default=30, help="kernels to list (default 30)")
    a = ap.parse_args()
    text = sys.stdin.read() if a.csv == "-" else open(a.csv, encoding="utf-8", errors="replace").read()
    times = read(text)
    total = sum(sum(v) for v in times.values())
    launches = sum(len(v) for v in times.values())
    print(f"{launches} launches, {total * 1e3:.3f} ms of kernel time in all")
    print(f"| kernel | launches | total ms | share | mean us |")
    print(f"|---|--:|--:|--:|--:|")
    for name, v in sorted(times.items(), key=lambda kv: -sum(kv[1]))[:a.top]:
        s = sum(v)
        print(f"| {name} | {len(v)} | {s * 1e3:.3f} | {100 * s / total:.1f}% | {s / len(v) * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
