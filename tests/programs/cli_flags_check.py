#!/usr/bin/env python3
"""Malformed command lines of the examples (ctest's cli_flags_check), by class: every flag of
train, plot_memory and memory_tour given sizes, numbers, words and paths it must refuse. Each
refusal must exit 1 with exactly one stderr line that starts with 'error:' and names the flag,
before any training step, and leave nothing where an output flag pointed (the run's folder, which
is also its working directory, stays empty). Valid edge cases must still run (sizes exact to the
byte in the report). Output paths that cannot take the file (a device such as /dev/full, which a
rename would replace; a folder such as /proc that takes no new files) are refused before the
work, not at its end; every output is written by a rename, so a failed write keeps the old file.

usage: python3 tests/programs/cli_flags_check.py TRAIN PLOT_MEMORY [MEMORY_TOUR]
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

MIB = 1 << 20
STEP_LINE = re.compile(r"^step\s+[1-9]\d*/\d+\s+loss", re.M)  # a training step ran


def run(cmd, cwd, timeout=60, env=None):
    """A run that outlives its time counts as a failure of the case, not of this script."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout, cwd=cwd,
                              env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, -9, "", f"(still running after {timeout} s: killed)\n")


def argv(tool, base, change):
    """base with change applied: a value replaces the flag's, None removes the flag; the key
    '+' lists raw arguments appended as they are (unknown, repeated or value-less flags); the key
    'env' holds environment variables the run gets."""
    flags = dict(base)
    for k, v in change.items():
        if k in ("+", "env"):
            continue
        if v is None:
            flags.pop(k, None)
        else:
            flags[k] = v
    out = [tool]
    for k, v in flags.items():
        out += [k, v]
    return out + change.get("+", [])


class Checker:
    def __init__(self, out):
        self.out = out
        self.failures = []
        self.refused = 0

    def clear(self):
        for name in os.listdir(self.out):
            p = os.path.join(self.out, name)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)

    def refuse(self, tool, base, flag, change):
        cmd = argv(tool, base, change)
        r = run(cmd, self.out, timeout=20, env=change.get("env"))  # milliseconds; 20 s means it trained
        self.refused += 1
        shown = " ".join(repr(a) if a == "" or " " in a else a for a in cmd[1:])
        lines = r.stderr.split("\n")
        problems = []
        if r.returncode != 1:
            problems.append(f"exit {r.returncode}, not 1")
        if len(lines) != 2 or lines[1] != "":
            problems.append(f"{len(r.stderr.splitlines())} stderr lines, not 1")
        if not r.stderr.startswith("error:"):
            problems.append("stderr does not start with 'error:'")
        if flag not in lines[0]:
            problems.append(f"the error does not name {flag}")
        if STEP_LINE.search(r.stdout):
            problems.append("a training step ran before the refusal")
        left = os.listdir(self.out)
        if left:
            problems.append(f"it wrote {left}")
            self.clear()
        if problems:
            self.failures.append(f"{os.path.basename(tool)} {shown}: {'; '.join(problems)}\n    stderr: {r.stderr!r}")

    def accept(self, tool, base, change, check=None):
        cmd = argv(tool, base, change)
        r = run(cmd, self.out)
        shown = " ".join(cmd[1:])
        if r.returncode != 0:
            self.failures.append(f"{os.path.basename(tool)} {shown}: exit {r.returncode}\n    stderr: {r.stderr!r}")
        elif check is not None:
            why = check(r)
            if why:
                self.failures.append(f"{os.path.basename(tool)} {shown}: {why}")
        self.clear()
        return r


def main():
    if len(sys.argv) not in (3, 4):
        print(__doc__.strip().splitlines()[-1])
        return 2
    # Absolute: each run's working directory is its output folder.
    train, plot = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    tour = os.path.abspath(sys.argv[3]) if len(sys.argv) == 4 else None
    with tempfile.TemporaryDirectory() as tmp:
        p = lambda *n: os.path.join(tmp, *n)
        out = p("out")
        for d in ("out", "adir"):
            os.mkdir(p(d))
        line = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.\n"
        open(p("tiny.txt"), "w").write(line * 100)  # 8.7 KB: enough for --seq 16
        open(p("long.txt"), "w").write(line * 200)  # 17 KB: enough for --seq 1024
        open(p("short.txt"), "w").write(line)        # too short for a tenth of validation text
        open(p("blank.txt"), "w").write("\n" * 1000)  # long enough, but no paragraph
        open(p("other.txt"), "w").write(line.upper() * 100)  # another text of the same length
        open(p("empty.txt"), "w").close()
        open(p("corrupt.ckpt"), "wb").write(b"MBCKPT\0\1 not a checkpoint")
        fifo = p("fifo")
        os.mkfifo(fifo)
        open(p("notjson.json"), "w").write("{not json")
        c = Checker(out)
        missing, adir, tiny = p("nofolder", "x"), p("adir"), p("tiny.txt")

        # --- train -----------------------------------------------------------------------------
        base = {"--data": tiny, "--steps": "2", "--eval-every": "0", "--sample": "0", "--width": "32",
                "--heads": "4", "--seq": "16", "--batch": "2",
                "--report": p("out", "report.json"), "--trace": p("out", "trace.json")}
        bad = {
            # Sizes: finite, positive, whole bytes after the unit, below 2^64, no stray text.
            "--budget": ["inf", "nan", "1e300", "1e30GiB", "0.5", "0", "-1", "0x10", " 5", "5 MiB", "5mb", "1.5B",
                         "1.3KiB", "1e-4KB", "18446744073709551616", "", "32MiBx", "+5MiB", "1MiB"],
            "--foreign": ["1MiB", "1MiB@", "@1", "1MiB@0", "1MiB@-1", "1MiB@1x", "1MiB@3", "0@1", "inf@1", "0.5@1",
                          "1e30GiB@1", "32MiB@1", "1MiB@1@2", " 1MiB@1", "1MiB@ 1"],
            # Whole numbers: digits only, within the flag's range (some bounded by --steps 2).
            "--warmup": ["-1", "3", "1.5", "", "99999999999999999999999", "+1", " 1", "0x1"],
            "--seed": ["-1", "18446744073709551616", "abc", "1e3", ""],
            "--width": ["-1", "0", "16385", "0x10", "1e2", "+32", " 32", "abc", "18446744073709551615"],
            "--heads": ["0", "-4", "1025"],
            "--seq": ["0", "-1", "1048577", "x"],
            "--batch": ["0", "-2", "65537"],
            "--steps": ["0", "-1", "1000000001", "2.5"],
            "--threads": ["0", "-1", "257", "many"],
            "--zero": ["4", "-1", "one", ""],
            "--overlap": ["2", "-1", "yes", ""],
            "--plan-only": ["2", "-1", "yes", ""],
            "--timeout": ["-1", "86401", "1.5", "x", ""],
            "--eval-every": ["-1", "3"],
            "--eval-sequences": ["0", "-1", "4097"],
            "--sample": ["-1", "1000001"],
            "--save-every": ["-1", "3"],
            "--stop-after": ["-1", "3", "1.0"],
            "--accept-changes": ["2", "-1", "yes", "", "1"],  # 1: without --resume
            # Reals: finite and in range.
            "--lr": ["nan", "inf", "-inf", "0", "-0.1", "2", "1e999", "1e-400", "0x1p-3", " 0.1", "abc", ""],
            "--min-lr": ["nan", "-1", "0.1", "inf"],
            "--weight-decay": ["nan", "-0.1", "2", "inf"],
            "--clip": ["nan", "-1", "inf", "1e7"],
            # Words.
            "--precision": ["fp64", "FP32", ""],
            "--optimizer": ["adam", "ADAMW8BIT", "adamw8bit ", ""],
            "--attention-kernels": ["MMA", "wgmma", "mma ", ""],
            "--device": ["gpu", "CUDA", "cpu ", ""],
            "--schedule": ["every:2x", "binomial:-1", "every:0", "binomial:0", "every:", "every:5", "every:+2", "bogus",
                           "every:99999999999999999999999", "EVERY:2", "every: 2", "", "auto "],
            "--layers": ["attn,", ",attn", "attn,,mamba", "", "lstm", "ATTN", "attn ,mamba", ",".join(["attn"] * 129)],
            "--window": ["0", "-1", "1048577", "x", "", "8"],  # 8: no swa block in the default --layers
            "--pack": ["0", "-1", "4097", "x", ""],
            "--offload": ["host", "OPTIMIZER", "auto ", "", "zero3"],
            "--host-budget": ["1GiB"],  # without --offload
            # The mixture's flags need an attn_moe block (the default --layers has none: "4", "1.0").
            "--experts": ["4"],
            "--top-k": ["1"],
            "--capacity": ["1.0"],
            "--aux": ["0.1"],
            # Files: inputs exist, are files, readable, not empty; outputs in an existing folder.
            # A device or a pipe would be read without end, or wait for a writer forever.
            "--data": [p("missing.txt"), adir, p("empty.txt"), p("short.txt"), "", "/dev/zero", fifo],
            "--resume": [p("missing.ckpt"), adir, p("empty.txt"), p("corrupt.ckpt"), ""],
            # A device (/dev/full: written by a rename, so never a device) and a folder that takes
            # no new files (/proc, even for root) are refused before training, not at its end.
            "--report": [missing, adir, "", adir + "/", tiny, p("tiny.txt", "r.json"), "/dev/full",
                         "/proc/membound-report.json"],
            "--trace": [missing, adir, "", tiny, p("out", "report.json"), "/dev/full", "/proc/membound-trace.json"],
        }
        for flag, values in bad.items():
            for v in values:
                c.refuse(train, base, flag, {flag: v})
        for flag, change in [
            ("--heads", {"--width": "30"}),                         # 4 heads do not divide 30
            ("--heads", {"--heads": "3"}),                          # nor does 3 divide 32
            ("--width", {"--width": "36"}),                         # head size 9: no block takes it
            ("--width", {"--width": "8", "--heads": "2"}),          # head size 4: attention needs a multiple of 8
            ("--warmup", {"--steps": "1", "--warmup": "2"}),
            ("--foreign", {"--budget": "8MiB", "--foreign": "7.5MiB@1"}),  # over the headroom between steps
            ("--checkpoint", {"--checkpoint": p("out", "x.ckpt")}),        # given, but nothing saves
            ("--checkpoint", {"--save-every": "1", "--checkpoint": adir}),
            ("--checkpoint", {"--save-every": "1", "--checkpoint": missing}),
            ("--checkpoint", {"--stop-after": "1", "--checkpoint": ""}),
            ("--checkpoint", {"--save-every": "1", "--checkpoint": tiny}),  # would replace --data
            ("--checkpoint", {"--stop-after": "1", "--checkpoint": "/dev/null"}),  # replaced by a rename
            ("--checkpoint", {"--save-every": "1", "--checkpoint": "/proc/membound.ckpt"}),  # no new files there
            ("--min-lr", {"--lr": "0.001", "--min-lr": "0.002"}),
            ("--budget", {"--device": "cpu", "--budget": "0.5"}),  # a fraction is of a GPU's memory
            ("--attention-kernels", {"--device": "cpu", "--attention-kernels": "mma"}),  # the GPU's kernels
            ("--window", {"--layers": "ttt,swa"}),                  # a sliding-window block without its window
            ("--experts", {"--layers": "attn_moe", "--experts": "1"}),    # a mixture of one expert
            ("--experts", {"--layers": "attn_moe", "--experts": "257"}),
            ("--top-k", {"--layers": "attn_moe", "--top-k": "3"}),
            ("--top-k", {"--layers": "attn_moe", "--top-k": "0"}),
            ("--capacity", {"--layers": "attn_moe", "--capacity": "-1"}),
            ("--capacity", {"--layers": "attn_moe", "--capacity": "nan"}),
            ("--capacity", {"--layers": "attn_moe", "--capacity": "0.001"}),  # no slot for an expert
            ("--aux", {"--layers": "attn_moe", "--aux": "inf"}),
            ("--host-budget", {"--device": "cpu", "--offload": "auto", "--host-budget": "-1"}),
            # not a whole number of bytes
            ("--host-budget", {"--device": "cpu", "--offload": "auto", "--host-budget": "1.2MiB"}),
            # 1 MiB fits this model only with the optimizer's state offloaded; 100 KiB cannot hold it.
            ("--budget", {"--budget": "1MiB"}),
            ("--host-budget", {"--device": "cpu", "--budget": "1MiB", "--offload": "auto", "--host-budget": "100KiB"}),
            ("--host-budget", {"--device": "cpu", "--offload": "optimizer", "--schedule": "none",
                               "--host-budget": "100KiB"}),
            ("--seq", {"--seq": "max"}),                            # max on the CPU needs --pack
            ("--seq", {"--pack": "4", "--seq": "1"}),                # a packed row needs a token and its target
            ("--data", {"--pack": "4", "--data": p("blank.txt")}),  # no paragraph to pack
            ("--foo", {"+": ["--foo", "1"]}),
            ("--width", {"--width": None, "+": ["--width"]}),      # no value
            ("--steps", {"+": ["--steps", "3"]}),                   # given twice
        ]:
            c.refuse(train, base, flag, change)
        if not os.path.exists("/dev/nvidia0"):  # no GPU here: --device cuda is refused, naming the flag
            c.refuse(train, base, "--device", {"--device": "cuda"})
        else:  # activation offload runs on the CPU so far (optimizer offload on both)
            c.refuse(train, base, "--offload", {"--device": "cuda", "--offload": "activations"})

        # Valid edge cases still run, and sizes arrive in the report exactly.
        def report_says(**want):
            def check(r):
                got = json.load(open(os.path.join(out, "report.json")))
                wrong = {k: got.get(k) for k, v in want.items() if got.get(k) != v}
                return f"report has {wrong}, expected {want}" if wrong else None
            return check
        c.accept(train, base, {"--budget": "64MiB", "--steps": "1"}, report_says(budget_bytes=64 * MIB, steps=1))
        c.accept(train, base, {"--budget": "18446744073709551615"}, report_says(budget_bytes=2**64 - 1))
        c.accept(train, base, {"--budget": "0.5GiB"}, report_says(budget_bytes=512 * MIB))
        c.accept(train, base, {"--budget": "1.5e9B", "--foreign": "1MiB@2"},
                 report_says(budget_bytes=1500000000, foreign_bytes=MIB))
        c.accept(train, base, {"--seed": "18446744073709551615", "--warmup": "2", "--schedule": "every:4",
                               "--layers": "ttt_linear,attention,mamba,ttt_mlp", "--eval-every": "2", "--sample": "5"})
        c.accept(train, base, {"--precision": "bf16", "--lr": "1", "--min-lr": "0", "--clip": "0",
                               "--weight-decay": "0", "--schedule": "binomial:4", "--threads": "1"})
        c.accept(train, base, {"--optimizer": "adamw8bit", "--precision": "bf16"})
        c.accept(train, base, {"--layers": "swa,attn,swa", "--window": "4"})  # local and global layers
        c.accept(train, base, {"--layers": "swa", "--window": "1048576"})    # a window past the sequence
        c.accept(train, base, {"--pack": "3", "--eval-every": "1"})           # paragraphs packed into rows
        def moe_says(choices):  # the report counts the mixtures' choices and drops over the run
            def check(r):
                m = json.load(open(os.path.join(out, "report.json"))).get("moe")
                if not m or m["choices"] != choices or not 0 <= m["dropped_choices"] <= choices or \
                        abs(m["dropped_fraction"] - m["dropped_choices"] / choices) > 1e-12 or \
                        not 0 < m["max_expert_rows"] <= 2 * 16:
                    return f"report's moe is {m}, expected {choices} choices"
                return None
            return check
        # 2 steps x 2 x 16 tokens x top-1 x 2 mixture blocks = 128 choices.
        c.accept(train, base, {"--layers": "attn_moe,mamba,attn_moe", "--experts": "4", "--top-k": "1",
                               "--capacity": "1.5", "--aux": "0.05"}, moe_says(128))  # mixtures of experts
        # the longest row that fits; one evaluation row (two of 32 rows of 6144 tokens took half the 60 s
        # limit alone at -O1, and passed it under ctest -j2's load)
        c.accept(train, base, {"--pack": "4096", "--seq": "max", "--steps": "1", "--eval-sequences": "1"})
        def host_says(**want):
            def check(r):
                got = json.load(open(os.path.join(out, "report.json")))["host"]
                wrong = {k: got.get(k) for k, v in want.items() if got.get(k) != v}
                if wrong:
                    return f"report's host has {wrong}, expected {want}"
                if got["measured_peak_bytes"] != got["predicted_peak_bytes"]:
                    return f"host space measured {got['measured_peak_bytes']} != predicted {got['predicted_peak_bytes']}"
                return None
            return check
        # Only an offloaded plan fits 1 MiB here: auto takes it, and the host's peak is its prediction.
        c.accept(train, base, {"--device": "cpu", "--budget": "1MiB", "--offload": "auto", "--host-budget": "1MiB"},
                 host_says(offload_optimizer=True, budget_bytes=MIB))
        c.accept(train, base, {"--device": "cpu", "--offload": "auto"},
                 host_says(offload_optimizer=False, predicted_peak_bytes=0))
        c.accept(train, base, {"--device": "cpu", "--offload": "optimizer", "--optimizer": "adamw8bit",
                               "--precision": "bf16"}, host_says(offload_optimizer=True))
        # At 40 MiB this model (one row of 1024 tokens) recomputes 47.5% of its forward with every
        # block input on the device and 18.6% with one of them on the host: activations offload it.
        tight = {"--data": p("long.txt"), "--width": "128", "--seq": "1024", "--batch": "1", "--budget": "40MiB"}
        c.accept(train, base, {**tight, "--device": "cpu", "--offload": "activations"},
                 host_says(offload_optimizer=False, activations_bytes=512 << 10))
        # all: the optimizer's state on the host frees the device enough to keep every input there.
        c.accept(train, base, {**tight, "--device": "cpu", "--offload": "all", "--host-budget": "16MiB"},
                 host_says(offload_optimizer=True, activations_bytes=0))
        c.accept(train, base, {"--zero": "1"})  # one process: ZeRO-1 is ZeRO-0
        c.accept(train, base, {"--zero": "2", "--timeout": "30"})  # and ZeRO-2 too; the timeout is MPI's only
        c.accept(train, base, {"--zero": "3"})  # and ZeRO-3
        # One process exchanges nothing: --overlap 1 is refused by name at every stage, never ignored.
        # The environment the trainer reads is checked with its flags, named as a flag is.
        for var, values in (("MEMBOUND_EXAMPLE_KILL", ["1", "a:3", "1:0", "1:x", "-1:3", ":", "1:2:3"]),
                            ("MEMBOUND_EXAMPLE_NCCL", ["2", "yes", ""])):
            for v in values:
                c.refuse(train, base, var, {"env": {var: v}})
        c.refuse(train, base, "--overlap", {"--zero": "2", "--overlap": "1"})
        c.refuse(train, base, "--overlap", {"--zero": "1", "--overlap": "1"})
        c.refuse(train, base, "--overlap", {"--overlap": "1"})
        c.accept(train, base, {"--overlap": "0"})
        # The plan and nothing else: no step line, exit 0.
        c.refuse(train, base, "--report", {"--plan-only": "1"})  # nothing trained: no report
        c.refuse(train, base, "--trace", {"--plan-only": "1", "--report": None})
        c.accept(train, base, {"--plan-only": "1", "--report": None, "--trace": None},
                 lambda r: "a step ran" if STEP_LINE.search(r.stdout) else
                 None if "predicted peak" in r.stdout else "no plan table")
        c.accept(train, base, {"--steps": "1", "--stop-after": "1"},
                 lambda r: None if os.path.exists(os.path.join(out, "train.ckpt")) else "no train.ckpt")
        # A checkpoint at step 2, kept outside the output folder for the next cases.
        ckpt = p("run.ckpt")
        c.accept(train, base, {"--stop-after": "2", "--checkpoint": ckpt})
        # The same flags continue the run; each flag that changes it from there is refused by its
        # own name (the error's argument), before the accepted change below rewrites the file.
        c.accept(train, base, {"--resume": ckpt}, lambda r: None if "resumed from" in r.stdout else "not resumed")
        for flag, value in [("--lr", "0.001"), ("--min-lr", "0"), ("--clip", "0.5"), ("--weight-decay", "0"),
                            ("--seed", "7"), ("--data", p("other.txt")), ("--steps", "3"), ("--warmup", "1")]:
            c.refuse(train, base, f"invalid argument '{flag}'", {"--resume": ckpt, flag: value})
        c.refuse(train, base, "invalid argument '--steps'",  # the checkpoint is past it
                 {"--resume": ckpt, "--steps": "1", "--accept-changes": "1"})
        c.accept(train, base, {"--resume": ckpt, "--steps": "3", "--save-every": "1", "--checkpoint": ckpt,
                               "--accept-changes": "1"},
                 lambda r: report_says(steps=3)(r) or
                 (None if "continuing under changed settings" in r.stdout else "the change not named"))
        c.refuse(train, base, "--resume", {"--resume": ckpt, "--width": "64", "--heads": "8"})  # another model
        c.refuse(train, base, "--report", {"--resume": ckpt, "--report": ckpt})  # would overwrite it

        # --- plot_memory -----------------------------------------------------------------------
        trace, report = p("trace.json"), p("report.json")
        events = [{"name": "memory by tag", "cat": "memory", "ph": "C", "ts": t, "pid": 1, "tid": 1,
                   "args": {"weights": 4 * MIB, "activations": a}} for t, a in [(0, 0), (100, 20 * MIB), (200, MIB)]]
        json.dump({"traceEvents": events}, open(trace, "w"))
        good_report = {"budget_bytes": 32 * MIB, "predicted_peak_bytes": 25 * MIB,
                       "thresholds": {"warning": 0.9, "critical": 0.95, "emergency": 0.97}}
        json.dump(good_report, open(report, "w"))

        def json_file(name, doc):
            path = p(name)
            json.dump(doc, open(path, "w"))
            return path
        neg = json_file("neg.json", {"traceEvents": [dict(events[0], args={"weights": -5})]})
        # Byte counts are whole numbers below 2^64: 1e300 and 0.5 are no count of bytes.
        huge = json_file("huge.json", {"traceEvents": [dict(events[0], args={"weights": 1e300})]})
        half = json_file("half.json", {"traceEvents": [dict(events[0], args={"weights": 0.5})]})
        pbase = {"--trace": trace, "--report": report, "--out": p("out", "mem.svg")}
        pbad = {
            "--budget": ["inf", "0", "-1", "0.5", "5 MiB", "1e30GiB", "nan", "", "0x20"],
            "--thresholds": ["0.9,0.95", "0.9,0.95,0.97,0.99", "0.97,0.95,0.9", "nan,0.95,0.97", "0.9,0.95,1.5",
                             " 0.9,0.95,0.97", "0.9,,0.97", "0x1p-1,0.95,0.97", "0,0.5,0.9", "", "0.9,0.95,0.97,",
                             "inf,inf,inf"],
            "--trace": [p("missing.json"), adir, p("empty.txt"), p("notjson.json"), json_file("list.json", []),
                        json_file("nocounters.json", {"traceEvents": []}), neg, huge, half, "", "/dev/zero", fifo],
            "--report": [p("missing.json"), adir, p("empty.txt"), p("notjson.json"),
                         json_file("b1.json", dict(good_report, budget_bytes=-1)),
                         json_file("b2.json", dict(good_report, budget_bytes="x")),
                         json_file("b3.json", dict(good_report, budget_bytes=0)),
                         json_file("b4.json", dict(good_report, predicted_peak_bytes=-5)),
                         json_file("b6.json", dict(good_report, budget_bytes=1e30)),
                         json_file("b7.json", dict(good_report, predicted_peak_bytes=1.5)),
                         json_file("b5.json", dict(good_report, thresholds={"warning": 0.97, "critical": 0.95,
                                                                            "emergency": 0.9})), ""],
            "--out": [missing, adir, "", adir + "/", trace, report, p("tiny.txt", "x.svg")],
        }
        for flag, values in pbad.items():
            for v in values:
                c.refuse(plot, pbase, flag, {flag: v})
        nobudget = json_file("nobudget.json", {"predicted_peak_bytes": 25 * MIB})
        for flag, change in [("--budget", {"--report": nobudget}), ("--budget", {"--report": None}),
                             ("--trace", {"--trace": None}), ("--out", {"--out": None}),
                             ("--foo", {"+": ["--foo", "1"]}), ("--title", {"+": ["--title"]})]:
            c.refuse(plot, pbase, flag, change)
        svg_written = lambda r: None if os.path.exists(os.path.join(out, "mem.svg")) else "no SVG written"
        c.accept(plot, pbase, {}, svg_written)
        c.accept(plot, pbase, {"--report": None, "--budget": "32MiB", "--thresholds": "0.5,0.5,1"}, svg_written)
        for v in ["/dev/full", "/proc/membound-mem.svg"]:
            c.refuse(plot, pbase, "--out", {"--out": v})

        # --- memory_tour -----------------------------------------------------------------------
        if tour:
            tbase = {"--steps": "1", "--trace": p("out", "tour.json")}
            tbad = {"--steps": ["-1", "0", "1e3", "10001", ""], "--budget-mib": ["-5", "0", "1.5", "1048577", "x"],
                    "--trace": [missing, adir, "", "/dev/full", "/proc/membound-tour.json"]}
            for flag, values in tbad.items():
                for v in values:
                    c.refuse(tour, tbase, flag, {flag: v})
            c.refuse(tour, tbase, "--foo", {"+": ["--foo", "1"]})
            c.refuse(tour, tbase, "--steps", {"--steps": None, "+": ["--steps"]})

    for f in c.failures:
        print(f"FAIL: {f}")
    print(f"cli_flags_check: {c.refused} malformed command lines, {len(c.failures)} failures")
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(main())
