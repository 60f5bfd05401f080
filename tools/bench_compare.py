#!/usr/bin/env python3
"""Two Google Benchmark JSON outputs of the same program, side by side: each benchmark's time and
one counter (default of_copy, bench_cuda_kernels' bandwidth over a device copy of the same bytes)
before and after, and the time ratio. A tool for notes, not part of ctest.

    python3 tools/bench_compare.py before.json after.json [--counter of_copy] [--markdown]
"""
import argparse
import json
import sys


def load(path):
    with open(path) as f:
        data = json.load(f)
    out = {}
    for b in data.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration" or "error_occurred" in b:
            continue
        out[b["name"]] = b
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--counter", default="of_copy")
    ap.add_argument("--markdown", action="store_true", help="a Markdown table")
    a = ap.parse_args()
    before, after = load(a.before), load(a.after)
    names = [n for n in after if n in before]
    if not names:
        print("bench_compare.py: no benchmark in both files", file=sys.stderr)
        return 1
    head = ["benchmark", "before us", "after us", "speedup", f"{a.counter} before", f"{a.counter} after"]
    rows = []
    for n in names:
        b, x = before[n], after[n]
        tb, tx = b["real_time"], x["real_time"]
        scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
        tb *= scale[b.get("time_unit", "ns")]
        tx *= scale[x.get("time_unit", "ns")]
        cb, cx = b.get(a.counter), x.get(a.counter)
        rows.append([n.replace("/manual_time", ""), f"{tb:.1f}", f"{tx:.1f}", f"{tb / tx:.2f}x",
                     "-" if cb is None else f"{cb:.2f}", "-" if cx is None else f"{cx:.2f}"])
    if a.markdown:
        print("| " + " | ".join(head) + " |")
        print("| --- |" + " --: |" * (len(head) - 1))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        for r in [head] + rows:
            print("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
