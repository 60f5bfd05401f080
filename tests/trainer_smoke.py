#!/usr/bin/env python3
"""A shortened run of the example trainer (ctest's trainer_smoke): the loss must fall and the
report's memory fields must be consistent: measured peak <= predicted peak <= budget, and the
plan's categories no larger than the peak. Bad flags must fail with one error line."""
import json
import subprocess
import sys
import tempfile
import os

train = sys.argv[1]
with tempfile.TemporaryDirectory() as d:
    report = os.path.join(d, "report.json")
    run = subprocess.run([train, "--steps", "40", "--width", "64", "--seq", "64", "--batch", "4",
                          "--eval-every", "0", "--sample", "20", "--budget", "256MiB",
                          "--report", report], capture_output=True, text=True, timeout=600)
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stderr
    r = json.load(open(report))
    for key in ["budget_bytes", "predicted_peak_bytes", "measured_peak_bytes", "steps",
                "final_train_loss", "final_eval_loss", "tokens_per_second", "plan", "policies"]:
        assert key in r, f"report lacks {key}"
    assert r["measured_peak_bytes"] <= r["predicted_peak_bytes"] <= r["budget_bytes"], r
    assert r["measured_peak_bytes"] == r["predicted_peak_bytes"], "the plan is exact on the CPU"
    p = r["plan"]
    assert p["weights"] + p["gradients"] + p["optimizer"] + p["activations"] <= r["predicted_peak_bytes"]
    assert r["final_eval_loss"] < r["initial_eval_loss"] - 0.5, (r["initial_eval_loss"], r["final_eval_loss"])
    assert r["tokens_per_second"] > 0

    for bad, what in [(["--layers", "ttt,lstm"], "--layers"), (["--budget", "1MiB"], "budget"),
                      (["--data", os.path.join(d, "missing.txt")], "--data"),
                      (["--budget", "12 parsecs"], "--budget")]:
        b = subprocess.run([train, "--steps", "1"] + bad, capture_output=True, text=True, timeout=120)
        assert b.returncode != 0, bad
        lines = [l for l in b.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and what in lines[0], (bad, b.stderr)
    corrupt = os.path.join(d, "bad.ckpt")
    open(corrupt, "wb").write(b"MBCKPT\0\1 not a checkpoint")
    b = subprocess.run([train, "--steps", "1", "--width", "64", "--seq", "64", "--batch", "4",
                        "--resume", corrupt], capture_output=True, text=True, timeout=120)
    assert b.returncode != 0 and "bad.ckpt" in b.stderr, b.stderr
print("trainer_smoke: ok")
