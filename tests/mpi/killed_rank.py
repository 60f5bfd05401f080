#!/usr/bin/env python3
"""A rank killed mid-run, at trainer level (ctest: mpi_killed_rank_zeroN).

The example trainer runs under `mpiexec -np 2` with sharded checkpoints every 5 steps and a
collective timeout of 5 s (--timeout 5). MEMBOUND_EXAMPLE_KILL=1:7 makes rank 1 SIGKILL itself
after step 7 (as kill -9 would), two steps after the step-5 checkpoint. mpiexec runs with
--enable-recovery, so that it does not end the survivor itself at once (its default): what is
checked is what membound does about a dead peer. Checked:

  1. rank 1 died by SIGKILL (exit status 137 through the shell that ran it);
  2. rank 0, the survivor, exits non-zero with membound's collective_timeout error on stderr
     ("not complete after 5000 ms"), within a bounded time: the whole run ends less than
     timeout + 30 s after it started (the steps themselves take well under a second here);
  3. the checkpoint on disk is the step-5 one: the manifest and the two shard files of step 5,
     no partial or temporary file;
  4. it loads and resumes: `--resume` at the same world size runs steps 6..12 and ends with the
     final training and evaluation losses of an uninterrupted run, bit for bit (the JSON
     report's doubles, compared as written);
  5. it resumes at another world size too: one process (ZeRO-0, --accept-changes 1 for the world
     it changes) re-shards the two shards and runs steps 6..12 to the uninterrupted run's final
     losses within 1e-5 relative (the same data and state; one process sums its sequences in
     another order than two ranks' exchange does).

  killed_rank.py --mpiexec MPIEXEC --train TRAIN [--zero 1|2|3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TIMEOUT_S = 5
BOUND_S = TIMEOUT_S + 30


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mpiexec", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--zero", default="1", choices=["1", "2", "3"])
    a = ap.parse_args()

    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_rmaps_base_oversubscribe": "1"})
    env.pop("MEMBOUND_EXAMPLE_KILL", None)
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(("ok:   " if ok else "FAIL: ") + what)
        if not ok:
            failures.append(what)

    with tempfile.TemporaryDirectory(prefix="membound_killed_rank_") as tmp:
        d = Path(tmp)

        def args(ckpt_dir: Path, report: str) -> list[str]:
            return [a.train, "--steps", "12", "--width", "64", "--seq", "32", "--batch", "4", "--eval-every", "0",
                    "--sample", "0", "--threads", "1", "--zero", a.zero, "--save-every", "5",
                    "--checkpoint", str(ckpt_dir / "run.ckpt"), "--timeout", str(TIMEOUT_S),
                    "--report", str(d / report)]

        mpi = [a.mpiexec, "-np", "2", "--oversubscribe"]
        # The uninterrupted run.
        (d / "ref").mkdir()
        ref = subprocess.run(mpi + args(d / "ref", "ref.json"), env=env, capture_output=True, text=True, timeout=300)
        check(ref.returncode == 0, f"the uninterrupted run succeeds (exit {ref.returncode})")
        if ref.returncode != 0:
            print(ref.stderr[-3000:])
            return 1

        # The run whose rank 1 dies after step 7. Each rank runs under a shell that writes down its
        # exit status (mpiexec's own status does not carry a rank's under --enable-recovery).
        run = d / "run"
        run.mkdir()
        rcs = d / "rcs"
        cmd = " ".join(f"'{x}'" for x in args(run, "killed.json"))
        shell = f"{cmd} 2> {d}/stderr.$OMPI_COMM_WORLD_RANK; echo $OMPI_COMM_WORLD_RANK $? >> {rcs}"
        kenv = dict(env, MEMBOUND_EXAMPLE_KILL="1:7")
        t0 = time.monotonic()
        killed = subprocess.run(mpi + ["--enable-recovery", "sh", "-c", shell], env=kenv, capture_output=True,
                                text=True, timeout=300)
        elapsed = time.monotonic() - t0
        status = {}
        for line in rcs.read_text().splitlines() if rcs.exists() else []:
            r, rc = line.split()
            status[int(r)] = int(rc)
        err0 = (d / "stderr.0").read_text() if (d / "stderr.0").exists() else ""
        err1 = (d / "stderr.1").read_text() if (d / "stderr.1").exists() else ""
        print(f"killed run: {elapsed:.2f} s, exit status by rank {status}, mpiexec {killed.returncode}")
        print("rank 0's error: " + next((l for l in err0.splitlines() if l.startswith("error:")), "(none)"))
        check(status.get(1) == 137 and "kills itself after step 7" in err1, "rank 1 died by SIGKILL after step 7")
        check(status.get(0, 0) != 0, "the surviving rank 0 exits non-zero")
        check(re.search(rf"error: rank 0: .*not complete after {TIMEOUT_S * 1000} ms", err0) is not None,
              "rank 0 says why: membound's collective_timeout, naming the timeout")
        check(elapsed < BOUND_S, f"within a bounded time: {elapsed:.2f} s < {BOUND_S} s")

        files = sorted(p.name for p in run.iterdir())
        print("on disk: " + ", ".join(files))
        check(files == ["run.ckpt", "run.ckpt.step-5.rank-0-of-2", "run.ckpt.step-5.rank-1-of-2"],
              "the step-5 checkpoint: its manifest and its two shards, nothing partial")
        # A copy for the resume at another world size (the resume below saves over run/ at step 10).
        shutil.copytree(run, d / "one")

        resumed = subprocess.run(mpi + args(run, "resumed.json") +
                                 ["--resume", str(run / "run.ckpt")], env=env, capture_output=True, text=True,
                                 timeout=300)
        check(resumed.returncode == 0 and "resumed from" in resumed.stdout and "at step 5" in resumed.stdout,
              f"the last checkpoint loads: resumed at step 5 (exit {resumed.returncode})")
        if resumed.returncode == 0:
            r = json.loads((d / "ref.json").read_text())
            s = json.loads((d / "resumed.json").read_text())
            print(f"final train loss: uninterrupted {r['final_train_loss']!r}, resumed {s['final_train_loss']!r}; "
                  f"eval {r['final_eval_loss']!r} / {s['final_eval_loss']!r}")
            check(s["steps"] == 12 and s["final_train_loss"] == r["final_train_loss"] and
                  s["final_eval_loss"] == r["final_eval_loss"],
                  "resumed to step 12: the uninterrupted run's final losses, bit for bit")
        else:
            print(resumed.stderr[-3000:])

        # The same checkpoint at another world size: one process re-shards it.
        one = args(d / "one", "one.json")
        one[one.index("--zero") + 1] = "0"
        one_proc = subprocess.run([a.mpiexec, "-np", "1"] + one + ["--resume", str(d / "one" / "run.ckpt"),
                                                                   "--accept-changes", "1"],
                                  env=env, capture_output=True, text=True, timeout=300)
        check(one_proc.returncode == 0 and "at step 5" in one_proc.stdout,
              f"one process resumes the 2-rank checkpoint at step 5 (exit {one_proc.returncode})")
        if one_proc.returncode == 0 and (d / "one.json").exists():
            r = json.loads((d / "ref.json").read_text())
            o = json.loads((d / "one.json").read_text())
            gap = max(abs(o[k] - r[k]) / abs(r[k]) for k in ("final_train_loss", "final_eval_loss"))
            print(f"one process: final train loss {o['final_train_loss']!r}, eval {o['final_eval_loss']!r}; "
                  f"worst relative gap to the uninterrupted 2-rank run {gap:.3g}")
            check(o["steps"] == 12 and gap <= 1e-5, "resumed by one process to step 12: the 2-rank losses within 1e-5")
        else:
            print(one_proc.stderr[-3000:])

    print(f"killed_rank (ZeRO-{a.zero}): " + ("all checks passed" if not failures else f"{len(failures)} failed"))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
