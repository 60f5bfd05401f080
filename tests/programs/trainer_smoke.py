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
    # The reserve: the arena's measured reserved peak is the plan's prediction, to the byte, and
    # the process grows by that much plus a fixed runtime overhead (thread stacks, the heap's
    # bookkeeping: about 1 MiB when measured), never by what the steps free and request again.
    assert r["measured_reserved_peak_bytes"] == r["predicted_reserved_peak_bytes"] <= r["budget_bytes"], r
    assert r["predicted_reserved_peak_bytes"] <= 1.05 * r["predicted_peak_bytes"], r
    if r["peak_rss_bytes"] and not r["address_sanitizer"]:
        grown = r["peak_rss_bytes"] - r["baseline_rss_bytes"]
        assert grown <= 1.05 * r["predicted_reserved_peak_bytes"] + 2 * 2**20, (grown, r)
    p = r["plan"]
    assert p["weights"] + p["gradients"] + p["optimizer"] + p["activations"] <= r["predicted_peak_bytes"]
    assert r["final_eval_loss"] < r["initial_eval_loss"] - 0.5, (r["initial_eval_loss"], r["final_eval_loss"])
    assert r["stopped_by"] is None, r["stopped_by"]
    assert r["tokens_per_second"] > 0

    # Resume: 8 steps, stop, resume for the other 8 = 16 uninterrupted steps, to the bit (the
    # report's losses are printed with 17 significant digits).
    small = ["--width", "64", "--seq", "64", "--batch", "4", "--steps", "16", "--eval-every", "0",
             "--sample", "0"]
    def report_of(args):
        rp = os.path.join(d, "r.json")
        run = subprocess.run([train] + small + args + ["--report", rp], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        return json.load(open(rp)), run.stdout
    whole, _ = report_of(["--budget", "256MiB", "--schedule", "full"])
    ckpt = os.path.join(d, "run.ckpt")
    half, _ = report_of(["--budget", "256MiB", "--schedule", "full", "--stop-after", "8", "--save-every", "8", "--checkpoint", ckpt])
    assert half["steps"] == 8
    rest, out = report_of(["--budget", "256MiB", "--schedule", "full", "--resume", ckpt])
    assert "resumed from" in out and rest["steps"] == 16
    for key in ["final_train_loss", "final_eval_loss"]:
        assert rest[key] == whole[key], (key, rest[key], whole[key])

    # Pressure: something else takes just more than the plan's headroom of an 8 MiB budget at
    # step 3; the step is retried under a stricter plan and the run goes on, with the measured
    # peak within the predictions. The foreign bytes follow from the plan that the same flags
    # give without them (a fixed 1 MiB stopped forcing a retry once plans got smaller).
    budget = 8 * 1024 * 1024
    calm, _ = report_of(["--budget", "8MiB", "--schedule", "auto"])
    assert calm["replans"] == 0 and calm["predicted_reserved_peak_bytes"] <= budget, calm
    foreign = budget - calm["predicted_reserved_peak_bytes"] + 256 * 1024
    press, out = report_of(["--budget", "8MiB", "--schedule", "auto", "--foreign", f"{foreign}B@3"])
    print(out[-1500:])
    assert press["replans"] >= 1 and "retrying the step under" in out, out
    assert press["foreign_bytes"] == foreign
    assert press["measured_peak_bytes"] <= press["predicted_peak_bytes"] <= press["budget_bytes"], press
    assert press["measured_reserved_peak_bytes"] <= press["predicted_reserved_peak_bytes"] <= press["budget_bytes"], press

    # Something else takes all but 256 KiB of the room between steps, less than any plan needs:
    # the run stops at step 3 with one error line naming both flags, and its report and trace
    # keep the two steps that ran, the error in the report's stopped_by.
    p = calm["plan"]
    taken = budget - (p["weights"] + p["gradients"] + p["optimizer"]) - 256 * 1024
    rp, tr = os.path.join(d, "stopped.json"), os.path.join(d, "stopped_trace.json")
    b = subprocess.run([train] + small + ["--budget", "8MiB", "--foreign", f"{taken}B@3", "--report", rp, "--trace", tr],
                       capture_output=True, text=True, timeout=600)
    lines = [l for l in b.stderr.splitlines() if l.strip()]
    assert b.returncode == 1 and len(lines) == 1 and "'--budget and --foreign'" in lines[0], b.stderr
    # The advice names what is lacking: the budget grown by it, or --foreign shrunk by it.
    assert "Raise --budget to at least" in lines[0] and "or take at most" in lines[0], lines[0]
    stopped = json.load(open(rp))
    assert stopped["steps"] == 2 and "least peak of any plan" in stopped["stopped_by"], stopped
    assert stopped["measured_peak_bytes"] <= stopped["predicted_peak_bytes"], stopped
    assert json.load(open(tr)), "the trace of the steps that ran is empty"

    # The trace of that run becomes a plot (the foreign bytes are in it as tag "other").
    if len(sys.argv) > 2:
        tr, rp, svg = (os.path.join(d, n) for n in ("t.json", "r.json", "mem.svg"))
        subprocess.run([train] + small + ["--budget", "8MiB", "--foreign", f"{foreign}B@3", "--trace", tr,
                                          "--report", rp], check=True, capture_output=True, timeout=600)
        p = subprocess.run([sys.argv[2], "--trace", tr, "--report", rp, "--out", svg],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and "wrote" in p.stdout, p.stderr
        text = open(svg).read()
        assert "budget" in text and "emergency" in text and "other" in text, "plot lacks its lines"

    for bad, what in [(["--layers", "ttt,lstm"], "--layers"), (["--budget", "1MiB"], "budget"),
                      (["--data", os.path.join(d, "missing.txt")], "--data"),
                      (["--budget", "12 parsecs"], "--budget"),
                      (["--foreign", "500MiB@1"], "budget")]:
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
