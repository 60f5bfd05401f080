#!/usr/bin/env python3
"""policy_grid on a tiny grid: every point that ran has measured peak == predicted peak, `pareto`
is exactly the non-dominated set over (time_ms, measured_peak_bytes) among the points that ran,
points over --budget are marked fits: false and not run, the SVG is well-formed XML with a budget
line, every compile-time variant differs from the base on its own axis only, --vary and --config
are honoured; and bad input (unknown layer or axis, --backend cuda, a budget no point fits, an
unwritable output, a corrupt or misspelt --config, a bad key in it even where a flag overrides it)
exits 1 with one `error:` line naming the flag or key and writes nothing; a budget past any machine
(2^64 - 1 bytes, 100 TiB) runs.

usage: policy_grid_check.py PATH/TO/policy_grid
"""
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

TINY = ["--quick", "--width", "32", "--heads", "4", "--seq", "32", "--batch", "2", "--repetitions", "1",
        "--threads", "1"]

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run(exe, args):
    return subprocess.run([exe] + args, capture_output=True, text=True, timeout=300)


def grid(exe, tmp, name, extra):
    paths = {k: os.path.join(tmp, f"{name}.{k}") for k in ("json", "csv", "svg")}
    base = TINY
    if "--repetitions" in extra:  # the flag once: CLI11 refuses a repeat
        i = TINY.index("--repetitions")
        base = TINY[:i] + TINY[i + 2:]
    r = run(exe, base + extra + ["--json", paths["json"], "--csv", paths["csv"], "--svg", paths["svg"]])
    check(r.returncode == 0, f"{name}: exit 0 (got {r.returncode}; stderr {r.stderr!r})")
    if r.returncode != 0:
        return None, paths
    with open(paths["json"]) as f:
        return json.load(f), paths


def check_points(name, doc, budget):
    pts = doc["points"]
    check(len(pts) >= 4, f"{name}: at least 4 points (got {len(pts)})")
    ran = [p for p in pts if p["measured_peak_bytes"] is not None]
    check(len(ran) >= 2, f"{name}: at least 2 points ran")
    for p in pts:
        label = f"{name}: {p['precision']} {p['schedule']} {p['micro_batch']}x{p['accumulation']} c{p['logit_chunk']}"
        for key in ("predicted_peak_bytes", "measured_peak_bytes", "measured_reserved_peak_bytes", "time_ms",
                    "time_ms_min", "time_ms_max", "tokens_per_second", "recompute_flops", "fits", "pareto",
                    "fit_choice"):
            check(key in p, f"{label}: has {key}")
        if budget is None:
            check(p["fits"], f"{label}: fits without a budget")
        else:
            over = p["predicted_reserved_peak_bytes"] > budget
            check(p["fits"] == (not over), f"{label}: fits == (predicted reserved peak <= budget)")
            if over:
                check(p["measured_peak_bytes"] is None and not p["pareto"], f"{label}: over the budget, not run")
        if p["measured_peak_bytes"] is not None:
            check(p["fits"], f"{label}: ran only when it fits")
            check(p["measured_peak_bytes"] == p["predicted_peak_bytes"],
                  f"{label}: measured {p['measured_peak_bytes']} == predicted {p['predicted_peak_bytes']}")
            check(p["measured_reserved_peak_bytes"] <= p["predicted_reserved_peak_bytes"],
                  f"{label}: measured reserved <= predicted reserved")
            check(p["time_ms_min"] <= p["time_ms"] <= p["time_ms_max"], f"{label}: min <= median <= max")
            if budget is not None:
                check(p["measured_reserved_peak_bytes"] <= budget, f"{label}: measured reserved <= budget")
    # The Pareto set, recomputed.
    def dominated(p):
        return any(q["time_ms"] <= p["time_ms"] and q["measured_peak_bytes"] <= p["measured_peak_bytes"] and
                   (q["time_ms"] < p["time_ms"] or q["measured_peak_bytes"] < p["measured_peak_bytes"])
                   for q in ran)
    for p in pts:
        expect = p in ran and not dominated(p)
        check(p["pareto"] == expect, f"{name}: {p['precision']} {p['schedule']} {p['micro_batch']}x{p['accumulation']} "
                                     f"c{p['logit_chunk']}: pareto {p['pareto']}, recomputed {expect}")
    check(any(p["pareto"] for p in pts), f"{name}: a non-empty Pareto front")
    check(sum(1 for p in pts if p["fit_choice"]) >= 1, f"{name}: fit's choice is marked")
    # The compile-time variants: the base, and each other differing from it on its own axis only.
    base = [p for p in pts if p["axis"] == ""]
    check(len(base) > 0, f"{name}: the base variant has points")
    if base:
        axes = set(base[0]["policies"])
        for p in pts:
            diff = {a for a in axes if p["policies"].get(a) != base[0]["policies"][a]}
            check(diff == ({p["axis"]} if p["axis"] else set()),
                  f"{name}: variant {p['variant']!r} differs from the base on {sorted(diff)}, its axis is {p['axis']!r}")
    return {p["axis"] for p in pts}


def check_svg(name, path, budget):
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        check(False, f"{name}: SVG well-formed ({e})")
        return
    check(root.tag.endswith("svg"), f"{name}: root element is svg")
    lines = [e for e in root.iter() if e.tag.endswith("line") and e.get("class") == "budget"]
    check(len(lines) == (1 if budget is not None else 0), f"{name}: {'one' if budget else 'no'} budget line")
    if lines:
        check(lines[0].get("x1") == lines[0].get("x2"), f"{name}: the budget line is vertical")
    check(any(e.tag.endswith("polyline") and e.get("class") == "pareto" for e in root.iter()),
          f"{name}: a Pareto front line")


def check_bad(exe, tmp, name, args, names=None):
    out = os.path.join(tmp, f"bad_{name}.json")
    before = set(os.listdir(tmp))
    r = run(exe, TINY + args + (["--json", out] if "--json" not in args else []))
    err = [l for l in r.stderr.splitlines() if l.strip()]
    check(r.returncode == 1, f"bad {name}: exit 1 (got {r.returncode})")
    check(len(err) == 1 and err[0].startswith("error: "), f"bad {name}: one error line (got {r.stderr!r})")
    if names is not None and err:
        check(names in err[0], f"bad {name}: the error names {names} (got {err[0]!r})")
    check(r.stdout == "", f"bad {name}: nothing on stdout (got {r.stdout[:200]!r})")
    check(set(os.listdir(tmp)) == before, f"bad {name}: nothing written")


def main():
    exe = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        doc, paths = grid(exe, tmp, "nobudget", [])
        if doc:
            varied = check_points("nobudget", doc, None)
            # The default --layers (ttt,attn,mamba,attn) takes every axis but TTT-MLP's alone.
            check(varied == {"", "precision", "attention_tiles", "attention_recompute", "scan_chunk",
                             "mamba_recompute", "ttt_mini_batch", "ttt_state_groups"},
                  f"nobudget: every axis varied (got {sorted(varied)})")
            check_svg("nobudget", paths["svg"], None)
            with open(paths["csv"]) as f:
                rows = f.read().splitlines()
            check(len(rows) == len(doc["points"]) + 1, "nobudget: CSV has a header and one row per point")
            # A budget between the least and the largest predicted reserve: some points over it.
            peaks = sorted(p["predicted_reserved_peak_bytes"] for p in doc["points"])
            budget = (peaks[0] + peaks[-1]) // 2
            doc2, paths2 = grid(exe, tmp, "budget", ["--budget", str(budget), "--vary", "precision",
                                                     "--statistic", "min", "--order", "sequential",
                                                     "--repetitions", "2"])
            if doc2:
                check_points("budget", doc2, budget)
                check(any(not p["fits"] for p in doc2["points"]), "budget: some points over the budget")
                check(any(p["schedule"].startswith("budget") for p in doc2["points"]), "budget: a DP point")
                check_svg("budget", paths2["svg"], budget)
                check({p["axis"] for p in doc2["points"]} == {"", "precision"}, "budget: --vary precision only")
                ran2 = [p for p in doc2["points"] if p["time_ms"] is not None]
                check(doc2["statistic"] == "min" and all(p["time_ms"] == p["time_ms_min"] for p in ran2),
                      "budget: --statistic min ranks by the least time")
                check(all(p["time_ms_min"] <= p["time_ms_median"] <= p["time_ms_max"] for p in ran2),
                      "budget: min <= median <= max")
        # --config: the same settings from a JSON file, a flag overriding one of them.
        cfg = os.path.join(tmp, "grid_config.json")
        with open(cfg, "w") as f:
            json.dump({"layers": "attn", "width": 32, "heads": 4, "seq": 16, "batch": 2, "vary": "none"}, f)
        out = os.path.join(tmp, "config.json")
        r = run(exe, ["--quick", "--config", cfg, "--seq", "24", "--repetitions", "1", "--json", out])
        check(r.returncode == 0, f"config: exit 0 (got {r.returncode}; stderr {r.stderr!r})")
        if r.returncode == 0:
            with open(out) as f:
                cdoc = json.load(f)
            check(cdoc["model"]["layers"] == "attn" and cdoc["model"]["seq"] == 24 and cdoc["model"]["width"] == 32,
                  f"config: the file's settings and the flag's override (got {cdoc['model']})")
            check({p["axis"] for p in cdoc["points"]} == {""}, "config: vary none gives the base only")
        check_bad(exe, tmp, "layer", ["--layers", "attn,nope"])
        check_bad(exe, tmp, "budget", ["--budget", "64KiB"])
        check_bad(exe, tmp, "output", ["--json", os.path.join(tmp, "no_such_folder", "g.json"),
                                       "--svg", os.path.join(tmp, "g_bad.svg")])
        check_bad(exe, tmp, "repetitions", ["--repetitions", "0"])
        check_bad(exe, tmp, "vary", ["--vary", "precision,nope"])
        check_bad(exe, tmp, "backend", ["--backend", "cuda"])
        check_bad(exe, tmp, "order", ["--order", "random"])
        check_bad(exe, tmp, "statistic", ["--statistic", "mean"])
        bad_cfg = os.path.join(tmp, "bad_config.json")
        with open(bad_cfg, "w") as f:
            f.write('{"width": 32,')
        check_bad(exe, tmp, "config_syntax", ["--config", bad_cfg])
        with open(bad_cfg, "w") as f:
            f.write('{"widht": 32}')
        check_bad(exe, tmp, "config_key", ["--config", bad_cfg])
        # A key is checked as strictly as its flag, where a flag on the line overrides it too (TINY
        # passes --width, --heads and --repetitions), and the error names the key.
        for name, text, line in [("width", '{"width": "abc"}', []),
                                 ("layers", '{"layers": ""}', ["--layers", "attn"]),
                                 ("repetitions", '{"repetitions": 0}', []),
                                 ("heads", '{"heads": 3}', []),
                                 ("budget", '{"budget": "1KiB"}', [])]:
            with open(bad_cfg, "w") as f:
                f.write(text)
            check_bad(exe, tmp, f"config_{name}", ["--config", bad_cfg] + line, names=f'--config key "{name}"')
        with open(bad_cfg, "w") as f:
            f.write('{"width": 1e400}')  # past a double: nlohmann's out_of_range, not a syntax error
        check_bad(exe, tmp, "config_huge_number", ["--config", bad_cfg], names="--config")
        # Budgets past any machine: the arena's range is capped (1 TiB), never wrapped or mapped whole.
        for budget in ["18446744073709551615", "100TiB"]:
            out = os.path.join(tmp, "huge_budget.json")
            r = run(exe, TINY + ["--vary", "none", "--budget", budget, "--json", out])
            check(r.returncode == 0, f"budget {budget}: runs (got {r.returncode}; stderr {r.stderr!r})")
            if os.path.exists(out):
                os.remove(out)
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("policy_grid_check: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
