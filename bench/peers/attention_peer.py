#!/usr/bin/env python3
"""Our attention layer against PyTorch's on the CPU (F.scaled_dot_product_attention), same
shapes, same inputs, same thread count, one run. A tool to run and report, not part of ctest.

Build the runner and run (from the repository root; the PyTorch here is /tmp/torchenv):

    cmake -S . -B /tmp/peer-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
          -DMEMBOUND_BUILD_TESTS=OFF -DMEMBOUND_ENABLE_CUDA=OFF
    cmake --build /tmp/peer-build --target attention_peer_runner
    /tmp/torchenv/bin/python bench/peers/attention_peer.py \
          --runner /tmp/peer-build/bench/attention_peer_runner --shapes quick
    /tmp/torchenv/bin/python bench/peers/attention_peer.py \
          --runner /tmp/peer-build/bench/attention_peer_runner --shapes all --reps 3

Shapes: B = 1, H = Hkv = 8, C = H·D, causal, T in {512, 1024} (quick) or {512, 1024, 2048,
4096} (all), D in {64, 128}; fp32 and bf16; forward and forward+backward.

The PyTorch layer is what a user writes (the construction of attention_reference_check.py):
nn.Linear(bias=False) projections whose weight is our W transposed (ours is y = x·W, W [in,
out]), RoPE rotate-half (LLaMA / GPT-NeoX) at position t with base 10000 (cos/sin tables built
once in float64 and cast to the layer's dtype, like a cached buffer), GQA by repeat_interleave,
F.scaled_dot_product_attention(is_causal=True), heads concatenated, y = o·Wo. The bf16 layer
holds bf16 weights and runs on bf16 activations. "fwd" runs PyTorch under torch.no_grad()
(inference: it keeps nothing for backward, its best case; ours still writes O and lse for
backward); "fwdbwd" runs y = layer(x) with x and the weights requiring grad, then
y.backward(dy), with x.grad and every weight .grad set to None before the call.

Inputs: x, dy ~ N(0, 1) and W ~ N(0, 1/fan_in), drawn in float32 from torch.manual_seed(0) for
each (T, D); the bf16 runs use the same values rounded to bf16. Each row writes them once to a raw
file (format in attention_peer_runner.cpp) and runs on it the runner (ours) and this script with
--torch-child (PyTorch), which take the same arguments, measure the same way and write their
outputs back in the same raw format: each twice, in fresh processes, `--mode time` (glibc's
default malloc settings) then `--mode memory` (see RSS below). Fresh processes keep one row's
heap state from leaking into the next row's numbers.

Columns:
  ours ms, torch ms     best of --reps wall times of one call, after one warm-up, both on
                        --threads threads (torch.set_num_threads; ours: a thread_pool).
  torch/ours            torch ms / ours ms: our speed-up.
  ours alloc MiB        our allocator statistics' peak over one call (saved + workspace): the
                        layer's own memory beyond inputs, outputs, weights and gradients.
  ours RSS MiB,         peak RSS growth over one call after a warm-up, the same method on both
  torch RSS MiB         sides, in a process started with glibc's mmap threshold fixed at 128 KiB
                        (MALLOC_MMAP_THRESHOLD_=131072 in its environment, and mallopt): by
                        default glibc raises the threshold as large buffers are freed, after which
                        buffers of up to 32 MiB come from the heap and stay resident once freed,
                        so a call's peak would count what earlier calls left there (ours at
                        T=4096 D=64 fp32 fwd+bwd read 108 MiB so, 84 MiB = allocator peak +
                        outputs with the threshold fixed). Then: malloc_trim(0), write "5" to
                        /proc/self/clear_refs (resets VmHWM to the current RSS), read VmRSS, run
                        one call that allocates its outputs (y; for fwdbwd also dx and the four
                        weight gradients), read VmHWM; report VmHWM - VmRSS before. Both include
                        the outputs (column "outputs MiB"); neither includes inputs and weights,
                        which exist before. Memory an allocator kept from the warm-up (MKL's
                        buffers, say) and reuses is resident already and not counted, either side.
  torch/ours mem        torch RSS / ours RSS.
  ours/torch CPU ms     the least process CPU time (every thread) of the timed calls: the work
                        done, which other processes on a shared machine do not inflate as they
                        do wall time (--threads threads both sides); torch/ours CPU their ratio.
  base ms, base CPU ms  with --base-runner (a runner built from another tree, e.g. main): its
                        wall and CPU times on the same input in the same row, and base/ours.
                        Ours runs before and after it (the better of the two is reported).
  Filters: --seqs, --dims, --precs, --passes; --time-only skips the memory runs and the output
  check.
  others' CPU           how many CPUs other processes kept busy, on average, while the row's two
                        timing processes ran: the machine's busy time (/proc/stat, steal included)
                        minus this script's and its children's CPU time, over that wall time. Timings are only as
                        good as the machine is quiet: on a 2-core machine a concurrent compile
                        (1.0 here) can halve either side's speed; read rows above ~0.1 with care.

Output check (the first shape of the set, T = 512, D = 64, unless --check-shape says otherwise;
both passes, both precisions): the same layer rebuilt in PyTorch float64 from the same inputs
(for bf16, the bf16-rounded inputs, upcast exactly) gives y and, through autograd, dx, dWq, dWk,
dWv, dWo. For each tensor we print max|ours - f64| / max|f64|, and the same for PyTorch's own
fp32 / bf16 layer as context. Exit status 1 when ours exceeds:
  fp32  1e-4: both sides are fp32 with different summation orders; values are O(1) and every
        output is a chain of a few sums of C = 512..1024 (projections) or T (attention) terms,
        whose rounding error is ~sqrt(n)·2^-24 ≈ 1e-6 relative, n·2^-24 ≈ 6e-5 at worst.
  bf16  2e-2: ours computes in fp32 from bf16 inputs; the reference sees the same bf16 inputs,
        so what remains is one rounding of each output to bf16 (≤ 2^-9 ≈ 2e-3 relative to the
        element, less relative to the tensor's max), plus the O that forward saves in bf16 for
        backward (another 2^-9 in Δ = rowsum(dO ⊙ O) and dWo = Oᵀ·dy); 2e-2 leaves a 5x margin
        over their sum, and a real error (a wrong sign, a missing term) is O(1).
"""
import argparse
import ctypes
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_CODE = {"fp32": 0, "bf16": 1}
H = HKV = 8
ROPE_BASE = 10000.0
TOL = {"fp32": 1e-4, "bf16": 2e-2}
MiB = float(1 << 20)

libc = ctypes.CDLL("libc.so.6")
M_MMAP_THRESHOLD = -3  # <malloc.h>
MMAP_THRESHOLD = 128 * 1024


# ---- Peak RSS growth of one call --------------------------------------------------------------
def proc_status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def rss_growth(fn):
    """Runs fn() once; returns (its result, VmHWM after - VmRSS before)."""
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = proc_status_bytes("VmRSS")
    result = fn()
    hwm = proc_status_bytes("VmHWM")
    return result, max(0, hwm - before)


# ---- The PyTorch layer --------------------------------------------------------------------------
def rotate_half(x):
    d = x.shape[-1] // 2
    return torch.cat([-x[..., d:], x[..., :d]], dim=-1)


def rope_tables(T, D, dtype):
    # inv_freq_i = 1 / base^(2i/D); angles [T, D/2] repeated to [T, D]; built in float64.
    inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def linear(w_in_out, dtype, requires_grad):
    C_in, C_out = w_in_out.shape
    lin = torch.nn.Linear(C_in, C_out, bias=False, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(w_in_out.T.to(dtype))
    lin.weight.requires_grad_(requires_grad)
    return lin


class TorchAttention(torch.nn.Module):
    def __init__(self, inputs, T, D, dtype, requires_grad):
        super().__init__()
        self.D = D
        self.wq = linear(inputs["wq"], dtype, requires_grad)
        self.wk = linear(inputs["wk"], dtype, requires_grad)
        self.wv = linear(inputs["wv"], dtype, requires_grad)
        self.wo = linear(inputs["wo"], dtype, requires_grad)
        self.cos, self.sin = rope_tables(T, D, dtype)

    def forward(self, x):
        B, T, _ = x.shape
        D = self.D
        q = self.wq(x).view(B, T, H, D).transpose(1, 2)    # [B, H, T, D]
        k = self.wk(x).view(B, T, HKV, D).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.wv(x).view(B, T, HKV, D).transpose(1, 2)
        q = q * self.cos + rotate_half(q) * self.sin
        k = k * self.cos + rotate_half(k) * self.sin
        if H != HKV:  # head h reads kv head h // (H / Hkv)
            k = k.repeat_interleave(H // HKV, dim=1)
            v = v.repeat_interleave(H // HKV, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, T, H * D))

    def grads_in_out(self):
        # nn.Linear.weight.grad is dW transposed: back to [in, out]
        return {n: getattr(self, "w" + n[-1]).weight.grad.T for n in ("dwq", "dwk", "dwv", "dwo")}


def torch_call(layer, x, dy, bwd, keep=False):
    """One call. With keep, returns the outputs (y; dx and weight gradients for bwd)."""
    if not bwd:
        with torch.no_grad():
            y = layer(x)
        out = {"y": y} if keep else None
        del y
        return out
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    y = layer(x)
    y.backward(dy)
    out = None
    if keep:
        out = {"y": y.detach(), "dx": x.grad}
        out.update(layer.grads_in_out())
    del y
    x.grad = None
    if not keep:
        for p in layer.parameters():
            p.grad = None
    return out


OUTPUT_NAMES = ("y", "dx", "dwq", "dwk", "dwv", "dwo")


def torch_child(path_in, path_out, prec, bwd, reps, threads, mode):
    """The PyTorch side of one row, in its own process: reads IN, prints one JSON line (the
    runner's modes: time, memory or all)."""
    if mode != "time":
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    torch.set_num_threads(threads)
    dtype = DTYPES[prec]
    with open(path_in, "rb") as f:
        B, T, C, h, hkv, D, causal, code = struct.unpack("<8Q", f.read(64))
        if (B, C, h, hkv, causal, code) != (1, H * D, H, HKV, 1, DTYPE_CODE[prec]):
            raise RuntimeError(f"{path_in}: a shape or dtype this script does not write")
        data = torch.frombuffer(bytearray(f.read()), dtype=dtype)
    inputs, at = {}, 0
    for name, r, c in (("x", T, C), ("wq", C, H * D), ("wk", C, HKV * D), ("wv", C, HKV * D),
                       ("wo", H * D, C), ("dy", T, C)):
        inputs[name] = data[at:at + r * c].view(r, c).clone()
        at += r * c
    del data
    layer = TorchAttention(inputs, T, D, dtype, requires_grad=bwd)
    x = inputs["x"].view(1, T, C).requires_grad_(bwd)
    dy = inputs["dy"].view(1, T, C)
    torch_call(layer, x, dy, bwd)  # warm-up
    best = best_cpu = float("inf")
    for _ in range(0 if mode == "memory" else reps):
        t0, c0 = time.perf_counter(), time.process_time()
        torch_call(layer, x, dy, bwd)
        best = min(best, (time.perf_counter() - t0) * 1e3)
        best_cpu = min(best_cpu, (time.process_time() - c0) * 1e3)
    result = {"threads": torch.get_num_threads()}
    if mode != "memory":
        result["ms"] = best
        result["cpu_ms"] = best_cpu
    if mode != "time":
        outputs, result["peak_rss_bytes"] = rss_growth(
            lambda: torch_call(layer, x, dy, bwd, keep=True))
        with open(path_out, "wb") as f:
            for name in OUTPUT_NAMES:
                if name in outputs:
                    f.write(raw_bytes(outputs[name].detach()))
    print(json.dumps(result))
    return 0


def reference_f64(inputs, T, D, prec):
    """y, dx, dWq, dWk, dWv, dWo in float64 from the inputs rounded to prec (then exact)."""
    dtype = DTYPES[prec]
    rounded = {k: v.to(dtype).to(torch.float64) for k, v in inputs.items()}
    layer = TorchAttention(rounded, T, D, torch.float64, requires_grad=True)
    x = rounded["x"].view(1, T, -1).requires_grad_(True)
    out = torch_call(layer, x, rounded["dy"].view(1, T, -1), bwd=True, keep=True)
    return {k: v.detach().reshape(-1, v.shape[-1]) for k, v in out.items()}


# ---- Ours, through the runner -------------------------------------------------------------------
def raw_bytes(t):
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def write_in(path_in, inputs, T, D, prec):
    with open(path_in, "wb") as f:
        f.write(struct.pack("<8Q", 1, T, H * D, H, HKV, D, 1, DTYPE_CODE[prec]))
        for name in ("x", "wq", "wk", "wv", "wo", "dy"):
            f.write(raw_bytes(inputs[name].to(DTYPES[prec])))


def run_side(program, mode, path_in, path_out, T, D, prec, bwd, reps, threads):
    """Runs the runner (program = [runner]) or the torch child on IN in a fresh process;
    returns (its JSON, its outputs: None in mode time)."""
    dtype = DTYPES[prec]
    C = H * D
    cmd = program + [path_in, path_out, "--prec", prec, "--pass", "fwdbwd" if bwd else "fwd",
                     "--reps", str(reps), "--threads", str(threads), "--mode", mode]
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mode != "time":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    if mode == "time":
        return stats, None
    with open(path_out, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=dtype)
    shapes = [("y", T, C)]
    if bwd:
        shapes += [("dx", T, C), ("dwq", C, H * D), ("dwk", C, HKV * D), ("dwv", C, HKV * D),
                   ("dwo", H * D, C)]
    outputs, at = {}, 0
    for name, r, c in shapes:
        outputs[name] = data[at:at + r * c].view(r, c).clone()
        at += r * c
    if at != data.numel():
        raise RuntimeError(f"{cmd[0]} wrote {data.numel()} elements, expected {at}")
    return stats, outputs


# ---- Driver -------------------------------------------------------------------------------------
def make_inputs(T, D):
    torch.manual_seed(0)
    C = H * D
    return {
        "x": torch.randn(T, C),
        "wq": torch.randn(C, H * D) / C ** 0.5,
        "wk": torch.randn(C, HKV * D) / C ** 0.5,
        "wv": torch.randn(C, HKV * D) / C ** 0.5,
        "wo": torch.randn(H * D, C) / (H * D) ** 0.5,
        "dy": torch.randn(T, C),
    }


def rel_err(got, want):
    diff = (got.to(torch.float64) - want).abs().max().item()
    scale = want.abs().max().item()
    err = diff / scale if scale > 0 else diff
    return err if err == err else float("inf")  # NaN fails


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def machine_busy_seconds():
    with open("/proc/stat") as f:
        v = [int(t) for t in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal: all but idle and iowait
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds():
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OthersCpu:
    """CPUs kept busy by other processes between start() and stop(), on average."""

    def start(self):
        self.t, self.busy, self.own = time.monotonic(), machine_busy_seconds(), own_cpu_seconds()

    def stop(self):
        wall = time.monotonic() - self.t
        others = (machine_busy_seconds() - self.busy) - (own_cpu_seconds() - self.own)
        return max(0.0, others / wall) if wall > 0 else 0.0


def load_average():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runner", help="path of attention_peer_runner")
    ap.add_argument("--torch-child", nargs=2, metavar=("IN", "OUT"),
                    help="internal: run the PyTorch side of one row on IN (as the runner does)")
    ap.add_argument("--prec", choices=tuple(DTYPES), help="with --torch-child")
    ap.add_argument("--pass", dest="pass_", choices=("fwd", "fwdbwd"), help="with --torch-child")
    ap.add_argument("--mode", choices=("all", "time", "memory"), default="all",
                    help="with --torch-child")
    ap.add_argument("--shapes", choices=("quick", "all"), default="quick")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--check-shape", default=None,
                    help="T,D of the output check (default: the first shape of the set)")
    ap.add_argument("--seqs", default=None, help="comma-separated T values (overrides --shapes)")
    ap.add_argument("--dims", default="64,128", help="comma-separated head dims")
    ap.add_argument("--precs", default="fp32,bf16", help="comma-separated: fp32, bf16")
    ap.add_argument("--passes", default="fwd,fwdbwd", help="comma-separated: fwd, fwdbwd")
    ap.add_argument("--base-runner", default=None,
                    help="a second runner (e.g. built from main) timed in the same row, "
                         "interleaved: columns base ms and base/ours")
    ap.add_argument("--time-only", action="store_true",
                    help="skip the memory runs and the output check (timings only)")
    args = ap.parse_args()
    if args.torch_child:
        return torch_child(*args.torch_child, args.prec, args.pass_ == "fwdbwd", args.reps,
                           args.threads, args.mode)
    if not args.runner:
        ap.error("--runner is required")

    torch.set_num_threads(args.threads)
    seqs = (512, 1024) if args.shapes == "quick" else (512, 1024, 2048, 4096)
    if args.seqs:
        seqs = tuple(int(v) for v in args.seqs.split(","))
    dims = tuple(int(v) for v in args.dims.split(","))
    precs = tuple(args.precs.split(","))
    passes = tuple(p == "fwdbwd" for p in args.passes.split(","))
    check = tuple(int(v) for v in args.check_shape.split(",")) if args.check_shape else \
        (seqs[0], dims[0])

    print(f"torch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}),"
          f" {args.threads} threads (torch.set_num_threads and ours), best of {args.reps}")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; load average at start: "
          f"{load_average()}")
    print(f"B=1 H=Hkv={H} C=H*D causal; torch fwd under no_grad; RSS = peak RSS growth of one call"
          " (outputs included)\n")
    base_cols = " base ms | base/ours |" if args.base_runner else ""
    # CPU time (all threads) of the best call: the work each side did, whatever the other
    # processes on a shared machine took; the wall-time ratio is the one the target uses.
    base_cols += " ours CPU ms | torch CPU ms | torch/ours CPU |"
    if args.base_runner:
        base_cols += " base CPU ms | base/ours CPU |"
    print("| T | D | prec | pass | ours ms | torch ms | torch/ours | ours alloc MiB | ours RSS MiB"
          " | torch RSS MiB | torch/ours mem | outputs MiB | others' CPU |" + base_cols)
    print("|--:|--:|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|" +
          ("--:|--:|" if args.base_runner else "") + "--:|--:|--:|" +
          ("--:|--:|" if args.base_runner else ""))
    sys.stdout.flush()

    checked = {}  # (prec, pass) -> (ours outputs, torch outputs)
    with tempfile.TemporaryDirectory(prefix="attention_peer_") as tmp:
        for D in dims:
            for T in seqs:
                inputs = make_inputs(T, D)
                for prec in precs:
                    path_in = os.path.join(tmp, "in.bin")
                    write_in(path_in, inputs, T, D, prec)
                    for bwd in passes:
                        side = (T, D, prec, bwd, args.reps, args.threads)
                        ours = ([args.runner], os.path.join(tmp, "ours.bin"))
                        theirs = ([sys.executable, os.path.abspath(__file__), "--torch-child"],
                                  os.path.join(tmp, "torch.bin"))
                        others = OthersCpu()
                        others.start()
                        o_time, _ = run_side(ours[0], "time", path_in, ours[1], *side)
                        t_time, _ = run_side(theirs[0], "time", path_in, theirs[1], *side)
                        base_ms = None
                        if args.base_runner:
                            b_time, _ = run_side([args.base_runner], "time", path_in, ours[1],
                                                 *side)
                            # ours again after the base: the better of two, as each side gets
                            o2, _ = run_side(ours[0], "time", path_in, ours[1], *side)
                            o_time["ms"] = min(o_time["ms"], o2["ms"])
                            o_time["cpu_ms"] = min(o_time.get("cpu_ms", float("inf")),
                                                   o2.get("cpu_ms", float("inf")))
                            base_ms = b_time["ms"]
                        busy = others.stop()
                        if args.time_only:
                            stats = {"ms": o_time["ms"], "peak_alloc_bytes": 0,
                                     "peak_rss_bytes": 0, "output_bytes": 0}
                            ours_out = torch_out = None
                            t_mem = {"peak_rss_bytes": 0}
                        else:
                            stats, ours_out = run_side(ours[0], "memory", path_in, ours[1], *side)
                            t_mem, torch_out = run_side(theirs[0], "memory", path_in, theirs[1],
                                                        *side)
                        stats["ms"] = o_time["ms"]
                        t_ms, t_rss = t_time["ms"], t_mem["peak_rss_bytes"]
                        if (T, D) == check and not args.time_only:
                            checked[(prec, bwd)] = (ours_out, torch_out)
                        o_rss = stats["peak_rss_bytes"]
                        o_cpu, t_cpu = o_time.get("cpu_ms", 0.0), t_time.get("cpu_ms", 0.0)
                        cpu_cols = (f" {o_cpu:.1f} | {t_cpu:.1f} | "
                                    f"{t_cpu / o_cpu if o_cpu else float('nan'):.2f} |")
                        if base_ms is not None:
                            b_cpu = b_time.get("cpu_ms", 0.0)
                            cpu_cols += (f" {b_cpu:.1f} | "
                                         f"{b_cpu / o_cpu if o_cpu else float('nan'):.2f} |")
                        print(f"| {T} | {D} | {prec} | {'fwd+bwd' if bwd else 'fwd'} "
                              f"| {stats['ms']:.2f} | {t_ms:.2f} | {t_ms / stats['ms']:.2f} "
                              f"| {stats['peak_alloc_bytes'] / MiB:.1f} | {o_rss / MiB:.1f} "
                              f"| {t_rss / MiB:.1f} "
                              f"| {t_rss / o_rss if o_rss else float('inf'):.2f} "
                              f"| {stats['output_bytes'] / MiB:.1f} | {busy:.2f} |" +
                              (f" {base_ms:.2f} | {base_ms / stats['ms']:.2f} |"
                               if base_ms is not None else "") + cpu_cols)
                        sys.stdout.flush()
                        del ours_out, torch_out

    print(f"\nload average at end: {load_average()}")
    if args.time_only:
        print("\n--time-only: no memory runs, no output check")
        return 0
    if not checked:
        print(f"\nno output check: T,D = {check} is not in the set")
        return 1
    T, D = check
    print(f"\nOutput check, T={T} D={D}: max|got - f64| / max|f64|, f64 = the same layer in "
          "PyTorch float64 (autograd for the gradients) on the same inputs (bf16: the "
          "bf16-rounded inputs)\n")
    print("| prec | pass | tensor | ours | torch | tol (ours) |")
    print("|---|---|---|--:|--:|--:|")
    ok = True
    inputs = make_inputs(T, D)
    for prec in ("fp32", "bf16"):
        ref = reference_f64(inputs, T, D, prec)
        for bwd in (False, True):
            if (prec, bwd) not in checked:
                continue
            ours_out, torch_out = checked[(prec, bwd)]
            for name, got in ours_out.items():
                e_ours, e_torch = rel_err(got, ref[name]), rel_err(torch_out[name], ref[name])
                bad = not e_ours <= TOL[prec]
                ok &= not bad
                print(f"| {prec} | {'fwd+bwd' if bwd else 'fwd'} | {name} | {e_ours:.2e} "
                      f"| {e_torch:.2e} | {TOL[prec]:g}{' FAIL' if bad else ''} |")
    print(f"\noutput check: {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
