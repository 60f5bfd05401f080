#!/usr/bin/env python3
"""Checks examples/plot_memory: a small synthetic trace becomes a well-formed SVG with the budget
line and the stacked areas, and a missing trace fails with exactly one 'error:' line.

usage: python3 tests/programs/plot_memory_check.py PATH_TO_plot_memory
"""
import json
import os
import subprocess
import sys
import tempfile
import xml.dom.minidom

MIB = 1 << 20


def counter(ts, weights, activations):
    args = {"weights": weights, "gradients": 0, "optimizer": 0, "activations": activations,
            "workspace": 0, "other": 0}
    return {"name": "memory by tag", "cat": "memory", "ph": "C", "ts": ts, "pid": 1, "tid": 1,
            "args": args}


def synthetic_trace():
    events = [{"name": "process_name", "ph": "M", "ts": 0, "pid": 1, "tid": 0,
               "args": {"name": "membound"}}]
    events += [counter(0.0, 0, 0), counter(10.5, 4 * MIB, 0), counter(250.0, 4 * MIB, 12 * MIB),
               counter(900.0, 4 * MIB, 29 * MIB), counter(1500.0, 4 * MIB, 2 * MIB)]
    events.append({"name": "pressure emergency", "cat": "pressure", "ph": "i", "s": "g",
                   "ts": 900.0, "pid": 1, "tid": 1,
                   "args": {"check_point": "after_forward", "from": "normal", "to": "emergency",
                            "usage": 33 * MIB, "limit": 32 * MIB}})
    events.append({"name": "step 1", "cat": "mark", "ph": "i", "s": "g", "ts": 1600.0,
                   "pid": 1, "tid": 1})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1])
        return 2
    tool = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        trace, report, svg = (os.path.join(tmp, n) for n in ("trace.json", "report.json", "memory.svg"))
        with open(trace, "w") as f:
            json.dump(synthetic_trace(), f)
        with open(report, "w") as f:
            json.dump({"budget_bytes": 32 * MIB, "predicted_peak_bytes": 34 * MIB,
                       "thresholds": {"warning": 0.9, "critical": 0.95, "emergency": 0.97}}, f)

        ok = run([tool, "--trace", trace, "--report", report, "--title", "check <&> title", "--out", svg])
        if ok.returncode != 0:
            failures.append(f"plot_memory exited {ok.returncode}: {ok.stderr.strip()}")
        elif not ok.stdout.startswith("wrote "):
            failures.append(f"expected a 'wrote ...' line, got {ok.stdout!r}")
        if os.path.exists(svg):
            with open(svg) as f:
                text = f.read()
            try:
                xml.dom.minidom.parseString(text)
            except Exception as e:  # any parser error means the SVG is not well-formed
                failures.append(f"SVG is not well-formed XML: {e}")
            for needle in ("budget", "<polygon", "predicted peak"):
                if needle not in text:
                    failures.append(f"SVG lacks {needle!r}")
        elif ok.returncode == 0:
            failures.append(f"exit 0 but no SVG at {svg}")

        missing = run([tool, "--trace", os.path.join(tmp, "missing.json"), "--budget", "32MiB",
                       "--out", os.path.join(tmp, "missing.svg")])
        lines = missing.stderr.splitlines()
        if missing.returncode == 0:
            failures.append("a missing trace file exited 0")
        if len(lines) != 1 or not lines[0].startswith("error:"):
            failures.append(f"a missing trace should print one 'error:' line, got {missing.stderr!r}")

    for f in failures:
        print(f"FAIL: {f}")
    if not failures:
        print("plot_memory_check: all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
