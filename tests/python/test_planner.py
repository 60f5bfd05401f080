"""The Python planner against the C++ one: each plan's table equals `train --plan-only 1`'s for the
same model, batch, budget, precision, optimizer and schedule (the trainer's fit passes its
emergency line, 97% of the budget, as prefer_below; here too), byte for byte; and every bad
argument is refused with a typed error that names it, before anything is computed.

Run by ctest (python_pytest) with PYTHONPATH at the build tree's module and MEMBOUND_TRAIN at
the example trainer.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess

import pytest

import membound

TRAIN = os.environ.get("MEMBOUND_TRAIN", "")

needs_train = pytest.mark.skipif(not TRAIN, reason="MEMBOUND_TRAIN (the example trainer) not given")


MPIEXEC = shutil.which("mpiexec") or ""


def trainer_table(args: list[str], ranks: int = 1) -> str:
    """The plan table `train --plan-only 1` prints: from its "plan:" line to its "recompute:" line
    (under `mpiexec -n ranks` when ranks > 1: rank 0's)."""
    cmd = [TRAIN, "--plan-only", "1", *args]
    env = None
    if ranks > 1:
        cmd = [MPIEXEC, "-n", str(ranks), "--oversubscribe", *cmd]
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    lines = out.splitlines(keepends=True)
    start = next(i for i, l in enumerate(lines) if l.startswith("plan: "))
    end = next(i for i, l in enumerate(lines) if l.startswith("  recompute: "))
    return "".join(lines[start:end + 1])


def emergency_line(budget: int) -> int:
    """The trainer's prefer_below: the byte under 97% of the budget (train_common.hpp)."""
    at = math.ceil(0.97 * budget)
    return at - 1 if 1 <= at < budget else 0


# (layers, width, heads, batch, seq, budget, precision, optimizer, schedule)
CASES = [
    (["ttt", "attn", "mamba", "attn"], 128, 4, 8, 128, "64MiB", "fp32", "adamw", "auto"),
    (["ttt", "attn", "mamba", "attn"], 128, 4, 8, 128, "24MiB", "fp32", "adamw", "auto"),  # accumulation
    (["ttt", "attn", "mamba", "attn"], 128, 4, 8, 256, "40MiB", "bf16", "adamw", "auto"),  # recompute
    (["mamba", "ttt_mlp", "attn"], 64, 2, 4, 64, "16MiB", "fp16", "adamw8bit", "auto"),
    (["ttt", "ttt", "attn", "mamba", "attn", "mamba"], 96, 3, 6, 96, "48MiB", "bf16", "adamw", "every:2"),
    (["ttt", "attn", "mamba", "attn"], 128, 4, 8, 128, "64MiB", "fp32", "adamw", "binomial:2"),
    (["attn", "attn"], 64, 4, 2, 32, "8MiB", "fp32", "adamw8bit", "full"),
    (["ttt", "attn", "mamba", "attn"], 128, 4, 8, 128, "64MiB", "fp32", "adamw", "none"),
]


@needs_train
@pytest.mark.parametrize("layers,width,heads,batch,seq,budget,precision,optimizer,schedule", CASES)
def test_table_equals_the_cpp_trainers(layers, width, heads, batch, seq, budget, precision, optimizer, schedule):
    want = trainer_table(["--layers", ",".join(layers), "--width", str(width), "--heads", str(heads),
                          "--batch", str(batch), "--seq", str(seq), "--budget", budget, "--precision", precision,
                          "--optimizer", optimizer, "--schedule", schedule, "--threads", "2"])
    model = membound.Model(layers=layers, width=width, heads=heads)
    if schedule == "auto":
        got = membound.fit(model, batch=batch, seq=seq, budget=budget, precision=precision, optimizer=optimizer,
                           threads=2, prefer_below=0.97)
        # The line as a size gives the same plan.
        line = emergency_line(membound.parse_size(budget))
        assert str(membound.fit(model, batch=batch, seq=seq, budget=budget, precision=precision,
                                optimizer=optimizer, threads=2, prefer_below=line)) == want
    else:
        got = membound.plan(model, batch=batch, seq=seq, schedule=schedule, budget=budget, precision=precision,
                            optimizer=optimizer, threads=2)
    assert str(got) == want
    assert got.fits


@needs_train
def test_local_attention_table_equals_the_cpp_trainers():
    """Sliding-window blocks: the same plan table as `train --layers swa,attn,... --window W`."""
    want = trainer_table(["--layers", "swa,attn,mamba,swa", "--window", "32", "--width", "128", "--heads", "4",
                          "--batch", "8", "--seq", "256", "--budget", "40MiB", "--precision", "bf16", "--threads", "2"])
    model = membound.Model(layers=["swa", "attn", "mamba", "local_attention"], width=128, heads=4, window=32)
    got = membound.fit(model, batch=8, seq=256, budget="40MiB", precision="bf16", threads=2, prefer_below=0.97)
    assert str(got) == want and got.fits
    # The window changes the work (fewer key positions), never the bytes: an attention layer's
    # buffers are linear in the sequence either way.
    full = membound.fit(membound.Model(layers=["attn", "attn", "mamba", "attn"], width=128, heads=4),
                        batch=8, seq=256, budget="40MiB", precision="bf16", threads=2, prefer_below=0.97)
    assert got.peak_bytes == full.peak_bytes and got.forward_flops < full.forward_flops


@needs_train
def test_mixture_of_experts_table_equals_the_cpp_trainers():
    """attn_moe blocks: the same plan table as `train --layers attn_moe,... --experts 4 --top-k 1 ...`."""
    want = trainer_table(["--layers", "attn_moe,mamba,attn_moe", "--experts", "4", "--top-k", "1", "--capacity", "1.5",
                          "--aux", "0.05", "--width", "128", "--heads", "4", "--batch", "8", "--seq", "128",
                          "--budget", "40MiB", "--threads", "2"])
    model = membound.Model(layers=["attn_moe", "mamba", "attention_moe"], width=128, heads=4, experts=4, top_k=1,
                           capacity=1.5, aux=0.05)
    got = membound.fit(model, batch=8, seq=128, budget="40MiB", threads=2, prefer_below=0.97)
    assert str(got) == want and got.fits
    # Four experts of the MLP's width: more parameters than the dense model's.
    dense = membound.fit(membound.Model(layers=["attn", "mamba", "attn"], width=128, heads=4),
                         batch=8, seq=128, budget="40MiB", threads=2, prefer_below=0.97)
    assert got.parameters > dense.parameters


@needs_train
def test_packed_rows_table_equals_the_cpp_trainers():
    """Packed rows: the tables of `train --pack 16 --seq 256` and of `--seq max` (the longest row
    fit_tokens admits under the emergency line)."""
    args = ["--width", "128", "--heads", "4", "--batch", "4", "--budget", "32MiB", "--threads", "2", "--pack", "16"]
    model = membound.Model(layers=["ttt", "attn", "mamba", "attn"], width=128, heads=4)
    got = membound.fit(model, batch=4, seq=256, sequences=16, budget="32MiB", threads=2, prefer_below=0.97)
    assert str(got) == trainer_table(args + ["--seq", "256"])
    assert got.micro_batch == 1 and got.accumulation == 4 and got.sequences == 16
    longest = membound.fit_tokens(model, max_tokens=65536, sequences=16, batch=4, budget="32MiB", threads=2,
                                  prefer_below=0.97)
    assert str(longest) == trainer_table(args + ["--seq", "max"])
    assert longest.seq % 64 == 0 and longest.seq > 256 and longest.fits
    # One row of 64 more tokens no longer fits under the line.
    with pytest.raises(membound.BudgetTooSmall):
        membound.fit(model, batch=1, seq=longest.seq + 64, sequences=16, budget=emergency_line(32 << 20), threads=2)


@needs_train
def test_offloaded_table_equals_the_cpp_trainers():
    """--offload: at a budget only an offloaded plan fits, the same table (both spaces) as `train
    --offload auto --host-budget ...`; with room, auto leaves the state on the device."""
    args = ["--width", "128", "--heads", "4", "--batch", "8", "--seq", "128", "--threads", "2", "--offload", "auto"]
    model = membound.Model(layers=["ttt", "attn", "mamba", "attn"], width=128, heads=4)
    got = membound.fit(model, batch=8, seq=128, budget="14MiB", threads=2, prefer_below=0.97, offload="auto",
                       host_budget="16MiB")
    assert str(got) == trainer_table(args + ["--budget", "14MiB", "--host-budget", "16MiB"])
    assert got.offload_optimizer and got.optimizer == 0 and got.fits
    assert got.host_peak == got.host_optimizer + got.host_staging <= 16 << 20
    with pytest.raises(membound.BudgetTooSmall):  # the state does not fit beside the step
        membound.fit(model, batch=8, seq=128, budget="14MiB", threads=2, prefer_below=0.97)
    roomy = membound.fit(model, batch=8, seq=128, budget="64MiB", threads=2, prefer_below=0.97, offload="auto")
    assert not roomy.offload_optimizer and roomy.host_peak == 0
    assert str(roomy) == trainer_table(args + ["--budget", "64MiB"])
    # A fixed schedule, always offloaded, 8-bit AdamW: its bucket is whole quantization blocks.
    fixed = membound.plan(model, batch=8, seq=128, schedule="full", budget="1GiB", threads=2, offload="optimizer",
                          optimizer="adamw8bit")
    assert str(fixed) == trainer_table(["--width", "128", "--heads", "4", "--batch", "8", "--seq", "128",
                                        "--threads", "2", "--offload", "optimizer", "--optimizer", "adamw8bit",
                                        "--schedule", "full", "--budget", "1GiB"])
    assert fixed.offload_optimizer and fixed.host_staging == 2 * 4 * fixed.offload_bucket
    # Too small a host space: named as the argument.
    with pytest.raises(membound.InvalidArgument) as e:
        membound.fit(model, batch=8, seq=128, budget="14MiB", threads=2, offload="auto", host_budget="1MiB")
    assert e.value.argument == "host_budget" and "device budget" in str(e.value)


@needs_train
def test_activation_offload_table_equals_the_cpp_trainers():
    """offload="activations": at 40 MiB one row of 1024 tokens keeps a block input on the host
    and recomputes 18.6% of its forward instead of 47.5%, the same table as `train --offload
    activations`; with no room on the host, the same budget keeps every input on the device."""
    args = ["--width", "128", "--heads", "4", "--batch", "1", "--seq", "1024", "--threads", "2", "--budget", "40MiB"]
    model = membound.Model(layers=["ttt", "attn", "mamba", "attn"], width=128, heads=4)
    got = membound.fit(model, batch=1, seq=1024, budget="40MiB", threads=2, prefer_below=0.97, offload="activations")
    assert str(got) == trainer_table(args + ["--offload", "activations"])
    assert got.host_activations == 512 << 10 and got.host_peak == got.host_activations
    assert got.offloaded_bytes == 512 << 10 and not got.offload_optimizer
    kept = membound.fit(model, batch=1, seq=1024, budget="40MiB", threads=2, prefer_below=0.97)
    assert got.recompute_flops < kept.recompute_flops and kept.host_peak == 0
    small = membound.fit(model, batch=1, seq=1024, budget="40MiB", threads=2, prefer_below=0.97,
                         offload="activations", host_budget="256KiB")
    assert small.host_activations == 0 and small.recompute_flops == kept.recompute_flops


def test_plan_fields_add_up():
    model = membound.Model(layers=["ttt", "attn", "mamba", "attn"], width=128, heads=4)
    p = membound.fit(model, batch=8, seq=128, budget="24MiB", threads=2)
    assert p.micro_batch * p.accumulation == 8 and p.seq == 128
    assert p.budget == 24 << 20 and p.fits
    assert p.peak_bytes <= p.reserved_peak <= p.budget  # the arena rounds to pages, never below
    assert p.peak_bytes <= p.weights + p.gradients + p.optimizer + p.activations + p.workspace
    assert p.parts["weights"] == p.weights == p.gradients  # fp32: gradients as the weights
    assert p.parameters > 0 and p.weights >= 4 * p.parameters
    # No budget, no stack: only the requested bytes.
    q = membound.plan(model, batch=8, seq=128)
    assert q.reserved_peak == 0 and q.budget == 0 and q.schedule == "none" and q.accumulation == 1


def test_allocators_differ_only_in_the_reserve():
    model = membound.Model(layers=["ttt", "attn"], width=64, heads=2)
    plans = {a: membound.plan(model, batch=4, seq=64, budget="64MiB", allocator=a) for a in ("arena", "caching", "none")}
    assert len({p.peak_bytes for p in plans.values()}) == 1
    assert plans["none"].reserved_peak == 0
    assert plans["arena"].reserved_peak >= plans["arena"].peak_bytes
    assert plans["caching"].reserved_peak > plans["caching"].peak_bytes  # 512-byte rounding, 2 MiB segments


def test_budget_too_small_names_the_least_budget_and_it_suffices():
    model = membound.Model(layers=["ttt", "attn", "mamba", "attn"], width=128, heads=4)
    with pytest.raises(membound.BudgetTooSmall) as e:
        membound.fit(model, batch=8, seq=128, budget="4MiB")
    assert e.value.argument == "budget" and e.value.budget == 4 << 20
    assert e.value.minimum > 4 << 20
    assert isinstance(e.value, membound.InvalidArgument) and isinstance(e.value, ValueError)
    p = membound.fit(model, batch=8, seq=128, budget=e.value.minimum)
    assert p.fits and max(p.peak_bytes, p.reserved_peak) <= e.value.minimum
    with pytest.raises(membound.BudgetTooSmall):
        membound.plan(model, batch=8, seq=128, schedule="none", budget=e.value.minimum - 1)


@pytest.mark.parametrize("text,bytes_", [("1", 1), ("512", 512), ("0.5KiB", 512), ("24GiB", 24 << 30),
                                          ("1.5GB", 1_500_000_000), ("2e3", 2000), ("1TiB", 1 << 40),
                                          (24 << 30, 24 << 30)])
def test_sizes(text, bytes_):
    assert membound.parse_size(text) == bytes_


@pytest.mark.parametrize("text", ["", "0", "-1", "+5", "5 MiB", "0x10", "inf", "1.3KiB", "0.5", "1mib",
                                  "1e30GiB", "18446744073709551616", True, 1.5, None, -3,
                                  "1e999999999999999999", "1e-999999999999999999", "\u0661\u0662GiB"])
def test_bad_sizes(text):
    with pytest.raises(membound.InvalidArgument) as e:
        membound.parse_size(text, "budget")
    assert e.value.argument == "budget"
    assert "budget" in str(e.value) and e.value.todo


MODEL = membound.Model(layers=["ttt", "attn"], width=64, heads=2)


@pytest.mark.parametrize("call,argument", [
    (lambda: membound.Model(layers=[], width=64, heads=2), "layers"),
    (lambda: membound.Model(layers="ttt", width=64, heads=2), "layers"),
    (lambda: membound.Model(layers=["ttt", "rnn"], width=64, heads=2), "layers"),
    (lambda: membound.Model(layers=["ttt"], width=0, heads=2), "width"),
    (lambda: membound.Model(layers=["ttt"], width=64, heads=3), "heads"),
    (lambda: membound.Model(layers=["ttt"], width=64, heads=4, kv_heads=3), "kv_heads"),
    (lambda: membound.Model(layers=["ttt"], width=64, heads=2, vocab=0), "vocab"),
    (lambda: membound.Model(layers=["ttt", "swa"], width=64, heads=2), "window"),
    (lambda: membound.Model(layers=["ttt", "swa"], width=64, heads=2, window=-1), "window"),
    (lambda: membound.Model(layers=["ttt", "attn"], width=64, heads=2, window=8), "window"),
    (lambda: membound.Model(layers=["attn_moe"], width=64, heads=2, experts=1), "experts"),
    (lambda: membound.Model(layers=["attn_moe"], width=64, heads=2, top_k=3), "top_k"),
    (lambda: membound.Model(layers=["attn_moe"], width=64, heads=2, capacity=float("nan")), "capacity"),
    (lambda: membound.Model(layers=["attn_moe"], width=64, heads=2, aux=-1), "aux"),
    (lambda: membound.fit("ttt", batch=1, seq=1, budget="1GiB"), "model"),
    (lambda: membound.fit(MODEL, batch=0, seq=64, budget="1GiB"), "batch"),
    (lambda: membound.fit(MODEL, batch=2, seq=2.5, budget="1GiB"), "seq"),
    (lambda: membound.fit(MODEL, batch=2, seq=64, budget="1GiB", precision="fp8"), "precision"),
    (lambda: membound.fit(MODEL, batch=2, seq=64, budget="1GiB", allocator="slab"), "allocator"),
    (lambda: membound.fit(MODEL, batch=2, seq=64, budget="1GiB", optimizer="sgd"), "optimizer"),
    (lambda: membound.fit(MODEL, batch=2, seq=64, budget="1GiB", threads=0), "threads"),
    (lambda: membound.fit(MODEL, batch=2, seq=64, budget="1GiB", head_chunks=()), "head_chunks"),
    (lambda: membound.fit(MODEL, batch=2, seq=64, budget="1GiB", prefer_below="1.5B"), "prefer_below"),
    (lambda: membound.fit(MODEL, batch=2, seq=64, budget="1GiB", sequences=-1), "sequences"),
    (lambda: membound.plan(MODEL, batch=2, seq=64, sequences=4), "batch"),
    (lambda: membound.fit_tokens(MODEL, max_tokens=0, sequences=4, budget="1GiB"), "max_tokens"),
    (lambda: membound.fit_tokens(MODEL, max_tokens=256, sequences=0, budget="1GiB"), "sequences"),
    (lambda: membound.fit_tokens(MODEL, max_tokens=256, sequences=4, budget="1GiB", multiple=512), "multiple"),
    (lambda: membound.fit_tokens(MODEL, max_tokens=256, sequences=4, budget=None), "budget"),
    (lambda: membound.plan(MODEL, batch=2, seq=64, schedule="every:3"), "schedule"),
    (lambda: membound.plan(MODEL, batch=2, seq=64, schedule="sqrt"), "schedule"),
    (lambda: membound.plan(MODEL, batch=2, seq=64, allocator="caching"), "budget"),
    (lambda: membound.plan(MODEL, batch=2, seq=64, head_chunk=0), "head_chunk"),
    (lambda: membound.fit(MODEL, batch=2, seq=64, budget=None), "budget"),
    (lambda: membound.fit(MODEL, batch=2, seq=64, budget="1GiB", prefer_below=1.5), "prefer_below"),
    (lambda: membound.fit(MODEL, batch=2, seq=64, budget="1GiB", prefer_below=float("nan")), "prefer_below"),
    (lambda: membound.fit(MODEL, batch=2, seq=64, budget="1GiB", offload="zero3"), "offload"),
    (lambda: membound.fit(MODEL, batch=2, seq=64, budget="1GiB", host_budget="1GiB"), "host_budget"),
    (lambda: membound.fit(MODEL, batch=2, seq=64, budget="1GiB", offload="auto", host_budget="1.5B"), "host_budget"),
    (lambda: membound.plan(MODEL, batch=2, seq=64, optimizer="none", offload="optimizer"), "offload"),
    (lambda: membound.Model(layers=["attn"], width=64, heads=64), "heads"),
    (lambda: membound.Model(layers=["ttt"] * 1025, width=64, heads=2), "layers"),
])
def test_bad_arguments_are_named(call, argument):
    with pytest.raises(membound.InvalidArgument) as e:
        call()
    assert e.value.argument == argument
    assert str(e.value).startswith(f"membound: invalid argument '{argument}'")


def test_the_library_checks_too():
    # A shape the Python checks pass but a layer refuses (TTT's head dimension must be even for
    # its rotary embedding): the C++ error crosses typed, with its fields.
    with pytest.raises(membound.InvalidArgument) as e:
        membound.plan(membound.Model(layers=["ttt"], width=63, heads=7), batch=1, seq=16)
    assert e.value.argument and e.value.expected and str(e.value).startswith("membound: invalid argument")


def test_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", membound.__version__)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml")) as f:
        assert f'version = "{membound.__version__}"' in f.read()


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_no_leak_across_a_thousand_plans():
    model = membound.Model(layers=["attn"], width=32, heads=2)
    for _ in range(100):  # warm: the allocator's pools, the interpreter's caches
        membound.fit(model, batch=2, seq=16, budget="64MiB")
    before = resident_bytes()
    for k in range(1000):
        membound.fit(model, batch=2, seq=16, budget="64MiB")
        if k % 10 == 0:  # and a hundred refusals, whose error objects cross into Python
            with pytest.raises(membound.BudgetTooSmall):
                membound.fit(model, batch=2, seq=16, budget=4096)
    grown = resident_bytes() - before
    assert grown < 2 << 20, f"resident memory grew by {grown} bytes over 1,000 plans and 100 refusals"


@needs_train
@pytest.mark.skipif(not MPIEXEC, reason="no mpiexec")
@pytest.mark.parametrize("zero,overlap,budget", [(1, False, "64MiB"), (2, False, "64MiB"), (2, True, "64MiB"),
                                                 (3, False, "64MiB"), (3, True, "64MiB"), (3, False, "20MiB")])
def test_rank_table_equals_the_cpp_trainers_under_mpirun(zero, overlap, budget):
    """Rank 0's plan over 2 MPI ranks, ZeRO-1 to 3 (3: the weights sharded, the gathered ones in
    their own line), as `mpiexec -n 2 train --zero Z --overlap O --plan-only 1` prints it; rank 1's
    plan differs from rank 0's only by its shard."""
    args = ["--layers", "ttt,attn,mamba,attn", "--width", "128", "--heads", "4", "--batch", "8", "--seq", "128",
            "--budget", budget, "--threads", "2", "--zero", str(zero), "--overlap", str(int(overlap))]
    want = trainer_table(args, ranks=2)
    model = membound.Model(layers=["ttt", "attn", "mamba", "attn"], width=128, heads=4)
    got = membound.fit(model, batch=8, seq=128, budget=budget, threads=2, prefer_below=0.97, ranks=2, rank=0,
                       zero=zero, overlap=overlap)
    assert str(got) == want
    whole = membound.fit(model, batch=8, seq=128, budget=budget, threads=2, prefer_below=0.97)
    if zero == 3:
        assert got.weight_gather > 0 and got.weights < whole.weights
    else:
        assert got.weight_gather == 0 and got.weights == whole.weights


def test_ranks_arguments_are_checked():
    model = membound.Model(layers=["ttt", "attn"], width=64, heads=2)
    for kwargs, name in [({"ranks": 0}, "ranks"), ({"ranks": 2, "rank": 2}, "rank"), ({"zero": 4}, "zero"),
                         ({"overlap": True}, "overlap"), ({"ranks": 3}, "batch"), ({"ranks": 2, "overlap": 1}, "overlap")]:
        with pytest.raises(membound.InvalidArgument) as e:
            membound.fit(model, batch=4, seq=32, budget="64MiB", **kwargs)
        assert e.value.argument == name
    # Rank 1 of 2 under ZeRO-3 plans the other half of the weights: the two shards add up to the model.
    r0 = membound.plan(model, batch=4, seq=32, ranks=2, rank=0, zero=3)
    r1 = membound.plan(model, batch=4, seq=32, ranks=2, rank=1, zero=3)
    one = membound.plan(model, batch=4, seq=32)
    assert r0.weights + r1.weights == one.weights
    assert r0.weight_gather == r1.weight_gather > 0
    assert r0.micro_batch == 2 and one.micro_batch == 4


# ---- Device plans (device="cuda": the CUDA layers and the device stacks, no GPU needed) ----------

plans_cuda = "cuda" in membound._core.plans_devices()
needs_device_planner = pytest.mark.skipif(not plans_cuda, reason="this build has no device planner (no nvcc)")

# The GPU example trainer's default model: 12 blocks of width 768, 12 heads.
GPU_DEFAULT = membound.Model(layers=["ttt", "attn", "mamba", "attn"] * 3, width=768, heads=12)


@needs_device_planner
def test_device_plan_is_what_the_h200_runs_measured():
    """The device plans of `train --device cuda` runs on an H200 whose measured peaks equalled
    their predictions (bench/results/gpu_h200_2026-11-29.md, logged to 0.1 MB / 0.1 MiB): bf16,
    8 GiB, the default 8 x 2048 tokens with AdamW (5017.6 MB) and 8-bit AdamW (4480.5 MB), and the
    soak's 1 x 256 (1521.9 MB requested, 1452.0 MiB reserved by the arena after step 1)."""
    runs = [(8, 2048, "adamw", 5017.6), (8, 2048, "adamw8bit", 4480.5), (1, 256, "adamw", 1521.9)]
    for batch, seq, optimizer, measured_mb in runs:
        p = membound.fit(GPU_DEFAULT, batch=batch, seq=seq, budget="8GiB", precision="bf16", optimizer=optimizer,
                         prefer_below=0.97, device="cuda")
        assert round(p.peak_bytes / 1e6, 1) == measured_mb, (batch, seq, optimizer, p.peak_bytes)
        assert (p.micro_batch, p.accumulation, p.schedule) == (batch, 1, "none")
    assert round(p.reserved_peak / 2**20, 1) == 1452.0, p.reserved_peak  # the soak's arena


@needs_device_planner
def test_device_plan_counts_the_device_layers():
    """A device plan is the CUDA layers' (cuBLASLt's workspace in every layer's) and its stack's
    2 MiB granules, not the CPU's: the same request differs, and its reserve is whole granules."""
    model = membound.Model(layers=["ttt", "attn", "mamba"], width=128, heads=4)
    cpu = membound.plan(model, batch=2, seq=256, precision="bf16", budget="1GiB")
    gpu = membound.plan(model, batch=2, seq=256, precision="bf16", budget="1GiB", device="cuda")
    assert gpu.workspace >= 32 << 20 > cpu.workspace  # cuBLASLt's 32 MiB on Hopper, reserved on every device
    assert gpu.reserved_peak % (2 << 20) == 0 and gpu.reserved_peak >= gpu.peak_bytes
    caching = membound.plan(model, batch=2, seq=256, precision="bf16", budget="1GiB", device="cuda",
                            allocator="caching")
    assert caching.peak_bytes == gpu.peak_bytes and caching.reserved_peak >= caching.peak_bytes
    packed = membound.fit_tokens(model, max_tokens=4096, sequences=8, budget="256MiB", precision="bf16",
                                 device="cuda")
    assert packed.sequences == 8 and packed.seq % 64 == 0 and packed.reserved_peak <= 256 << 20


@needs_device_planner
def test_device_plan_refuses_what_the_gpu_trainer_does_not_run():
    model = membound.Model(layers=["ttt", "attn"], width=64, heads=2)
    bad = [
        ("precision", dict(precision="fp16")),
        ("offload", dict(offload="activations")),
        ("offload", dict(offload="all")),
        ("zero", dict(ranks=2, batch=2, zero=2)),
        ("overlap", dict(ranks=2, batch=2, zero=1, overlap=True)),
        ("device", dict(device="tpu")),
    ]
    for name, change in bad:
        args = dict(batch=1, seq=64, budget="1GiB", device="cuda") | change
        with pytest.raises(membound.InvalidArgument) as e:
            membound.fit(model, **args)
        assert e.value.argument == name, change


@needs_device_planner
def test_device_plan_offloads_the_optimizer():
    """train --device cuda --offload optimizer: AdamW's state and two staging buckets in the host
    space (pinned), none of it on the device; the host part is the CPU plan's (the same state
    layout and buckets); auto offloads only when the device cannot hold the state beside the step."""
    model = membound.Model(layers=["ttt", "attn", "mamba"], width=256, heads=4)
    args = dict(batch=2, seq=256, precision="bf16", budget="1GiB", device="cuda")
    on = membound.fit(model, offload="optimizer", **args)
    off = membound.fit(model, **args)
    cpu = membound.fit(model, offload="optimizer", **(args | dict(device="cpu")))
    assert on.offload_optimizer and on.optimizer == 0 and off.optimizer > 0 and not off.offload_optimizer
    assert (on.host_optimizer, on.host_staging) == (cpu.host_optimizer, cpu.host_staging) and on.host_optimizer > 0
    assert on.host_peak == on.host_optimizer + on.host_staging
    assert on.peak_bytes < off.peak_bytes
    assert not membound.fit(model, offload="auto", **args).offload_optimizer  # 1 GiB holds the state
    # A budget that holds the step but not the state beside it: auto takes the host.
    tight = membound.fit(model, offload="auto", **(args | dict(budget=on.reserved_peak)))
    assert tight.offload_optimizer and tight.reserved_peak <= on.reserved_peak


@pytest.mark.skipif(plans_cuda, reason="this build plans for devices")
def test_device_plan_without_nvcc_is_a_typed_error():
    with pytest.raises(membound.InvalidArgument) as e:
        membound.fit(GPU_DEFAULT, batch=1, seq=64, budget="8GiB", device="cuda")
    assert e.value.argument == "device"
