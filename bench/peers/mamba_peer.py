#!/usr/bin/env python3
"""Our Mamba-1 block against the same block in PyTorch on the CPU (mamba_ssm's reference path),
same shapes, same inputs, same thread count, one run. A tool to run and report, not part of ctest.

Build the runner and run (from the repository root; the PyTorch here is /tmp/torchenv):

    cmake -S . -B /tmp/peer-build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
          -DMEMBOUND_BUILD_TESTS=OFF -DMEMBOUND_ENABLE_CUDA=OFF
    cmake --build /tmp/peer-build --target mamba_peer_runner
    /tmp/torchenv/bin/python bench/peers/mamba_peer.py \\
          --runner /tmp/peer-build/bench/mamba_peer_runner --shapes quick
    /tmp/torchenv/bin/python bench/peers/mamba_peer.py \\
          --runner /tmp/peer-build/bench/mamba_peer_runner --shapes all --reps 3

Shapes: B = 1, mamba_shape::defaults (Di = 2·C, Ns = 16, K = 4, R = ceil(C/16)), T = 1024
(quick) or T in {1024, 4096} (all), C in {256, 768}; fp32 and (unless --no-bf16) bf16; forward
and forward+backward. Ours runs the default recompute policy (`recompute`) with --chunk
(default 256).

The PyTorch block is mamba_ssm's Mamba.forward without its CUDA kernels, i.e. the way its
reference functions (mamba_inner_ref, selective_scan_ref) compute it; the construction is that of
mamba_reference_check.py (which checks it, in float64, against our naive reference):
  xz = in_proj.weight @ x (nn.Linear, no bias, [2·Di, C]), split into x, z  [b, Di, l];
  x = SiLU(Conv1d(Di, Di, K, groups=Di, padding=K-1, bias=True)(x)[..., :l])
      (mamba_inner_ref calls causal_conv1d_fn, a CUDA kernel; this is its definition);
  x_dbl = x_proj(x) (nn.Linear, no bias) -> dt [R], B [Ns], C [Ns];  dt = dt_proj.weight @ dt;
  selective_scan_ref(x, dt, A = -exp(A_log.float()), B, C, D.float(), z,
                     delta_bias=dt_proj.bias.float(), delta_softplus=True):
      u, Δ, B, C upcast to float32; Δ = softplus(Δ + bias); deltaA = exp(einsum(Δ, A)) and
      deltaB_u = einsum(Δ, B, u), both [b, Di, l, Ns]; the Python loop over l
      (x = deltaA[:, :, i]·x + deltaB_u[:, :, i]; y = einsum(x, C[:, :, i])); y + u·D; ·SiLU(z);
      cast back to the input dtype;
  out = out_proj(y) (nn.Linear, no bias).
One change from upstream, in the loop only: step i of deltaA, deltaB_u and C is read through
.unbind(2) rather than [:, :, i] (same operations, same order, same tensors kept; --literal
restores the indexing). With the indexing, autograd's backward of every deltaA[:, :, i] and
deltaB_u[:, :, i] materializes a full [b, Di, l, Ns] zero tensor (a fresh mmap'd allocation)
and adds it into the gradient: O(l^2·Di·Ns); measured here at T = 1024, C = 256, fp32, one
fwd+bwd call took 158 s instead of 6 s (on a loaded machine), and T = 4096 would take hours.
Either way the time is PyTorch's; the unbind form is the fair one to compare with. Of what
remains, nn.Conv1d's depthwise backward on the CPU is the largest part of torch's fwd+bwd (68% of
one call at T = 1024, C = 256, fp32, in torch.profiler), the per-step autograd nodes next.
Backward is torch autograd through all of it. "fwd" runs under torch.no_grad() (inference: it
keeps nothing for backward, its best case; ours still writes what backward needs). "fwdbwd" runs
out = block(x) with x and every parameter requiring grad, then out.backward(dy), with x.grad and
every .grad set to None before the call. The bf16 block holds bf16 parameters and runs on bf16
activations (its scan is in float32, as selective_scan_ref upcasts).

Inputs, drawn in float32 from torch.manual_seed(0) for each (T, C), mamba_simple's initialisation
nudged off its special values: in_proj, x_proj, out_proj U(±1/sqrt(fan_in)); conv weight and bias
U(±1/sqrt(K)); dt_proj U(±R^-0.5); dt_bias = softplus^-1(dt), dt log-uniform in [0.001, 0.1];
A_log = log(n+1) + U(±0.1); D = 1 + U(±0.2); x, dy ~ N(0, 1). The bf16 runs use the same values
rounded to bf16. They reach the runner as a raw file (see mamba_peer_runner.cpp), its outputs come
back the same way.

Columns:
  ours ms, torch ms     best of --reps wall times of one call, after one warm-up, both on
                        --threads threads (torch.set_num_threads; ours: a thread_pool).
  torch/ours            torch ms / ours ms: our speed-up.
  ours alloc MiB        our allocator statistics' peak over one call (saved + workspace): the
                        block's own memory beyond inputs, outputs, weights and gradients.
  ours RSS MiB,         peak RSS growth over one call, the same method on both sides: malloc_trim(0)
  torch RSS MiB         (free heap goes back to the OS), write "5" to /proc/self/clear_refs (resets
                        VmHWM to the current RSS), read VmRSS, run one call that allocates its
                        outputs (y; for fwdbwd also dx and the nine parameter gradients), read
                        VmHWM; report VmHWM - VmRSS before. Both therefore include the outputs
                        (column "outputs MiB"); neither includes inputs and weights, which exist
                        before. Pages an allocator kept from earlier calls and reuses are resident
                        already and not counted, on either side.
  torch/ours mem        torch RSS / ours RSS.

Output check (T = 1024, C = 256 unless --check-shape says otherwise; both passes, fp32 and bf16):
the same block rebuilt in PyTorch float64 from the same inputs (for bf16, the bf16-rounded inputs,
upcast exactly) gives out and, through autograd, dx and the nine parameter gradients. For each
tensor we print max|got - f64| / max|f64| for ours and for PyTorch's own fp32 / bf16 block, as
context. Exit status 1 when ours exceeds:
  fp32  1e-4: both sides are fp32 with different summation orders, on O(1) values. Every output
        is a chain of a few sums: projections over C = 256..768 or 2·Di terms, the scan over at
        most T = 1024 decaying terms, the weight gradients over T rows. Rounding error grows like
        sqrt(n)·2^-24 ≈ 2e-6 relative for n ~ 1e4 and n·2^-24 ≈ 6e-4 only if every rounding
        pointed the same way, which summing signed values does not do; exp, log1p and the
        sigmoid add a few ulp each. The gradients that sum over all T·Di (d_dt_bias, d_conv_b,
        d_d, d_a_log) are the most exposed; 1e-4 leaves a 10x margin over sqrt(n) growth there,
        and a real error (a wrong sign, a missing term, a state carried wrongly across a chunk
        boundary) is O(1e-2) or more.
  bf16  3e-2: ours computes in fp32 from bf16 inputs, but forward stores xz, x_dbl (and the
        recomputed conv output and Δ) rounded to bf16 and uses them as stored, and every output
        and gradient is rounded to bf16 once: about five independent roundings of 2^-9 ≈ 2e-3
        relative to an element on the way to any gradient, ~1e-2 if they add up; 3e-2 leaves a
        3x margin, and a real error is O(1).
"""
import argparse
import ctypes
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_CODE = {"fp32": 0, "bf16": 1}
NS, K = 16, 4  # mamba_shape::defaults
TOL = {"fp32": 1e-4, "bf16": 3e-2}
MiB = float(1 << 20)
WEIGHTS = ("in_proj", "conv_w", "conv_b", "x_proj", "dt_proj", "dt_bias", "a_log", "d",
           "out_proj")

libc = ctypes.CDLL("libc.so.6")


def dims(C):
    """mamba_shape::defaults(1, T, C): Di, Ns, K, R."""
    return 2 * C, NS, K, (C + 15) // 16


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


# ---- The PyTorch block --------------------------------------------------------------------------
def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       literal=False):
    """mamba_ssm.ops.selective_scan_interface.selective_scan_ref, real A, variable B and C
    ([b, Ns, l]): u, delta, z [b, Di, l]; A [Di, Ns]; D, delta_bias [Di].

    literal=False reads step i of deltaA, deltaB_u and C through .unbind(2) instead of
    [:, :, i]; nothing else differs (same operations in the same order, same tensors kept).
    Upstream's indexing is fine forward, but backward, autograd turns every deltaA[:, :, i] and
    deltaB_u[:, :, i] into a full [b, Di, l, Ns] zero tensor with one slice filled, added into
    the gradient: O(l^2·Di·Ns) work and a fresh mmap'd allocation per step (minutes at l = 1024,
    hours at l = 4096). unbind's backward stacks the l slice gradients once."""
    dtype_in = u.dtype
    u = u.float()
    delta = delta.float()
    if delta_bias is not None:
        delta = delta + delta_bias[..., None].float()
    if delta_softplus:
        delta = F.softplus(delta)
    batch, dim, dstate = u.shape[0], A.shape[0], A.shape[1]
    B = B.float()
    C = C.float()
    x = A.new_zeros((batch, dim, dstate))
    ys = []
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    if literal:
        for i in range(u.shape[2]):
            x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
            y = torch.einsum("bdn,bn->bd", x, C[:, :, i])
            ys.append(y)
    else:
        for dA_i, dBu_i, C_i in zip(deltaA.unbind(2), deltaB_u.unbind(2), C.unbind(2)):
            x = dA_i * x + dBu_i
            y = torch.einsum("bdn,bn->bd", x, C_i)
            ys.append(y)
    y = torch.stack(ys, dim=2)  # (batch dim L)
    out = y if D is None else y + u * D[:, None]
    if z is not None:
        out = out * F.silu(z)
    return out.to(dtype=dtype_in)


class TorchMamba(nn.Module):
    """Mamba (mamba_simple) without inference cache or fused kernels; weights from our layout
    (y = x·W, W [in, out]): nn.Linear.weight = W transposed, conv1d.weight [Di, 1, K]."""

    def __init__(self, w, C, dtype, requires_grad, literal=False):
        super().__init__()
        self.literal = literal
        Di, N, Kc, R = dims(C)
        self.Di, self.N, self.R = Di, N, R
        self.in_proj = nn.Linear(C, 2 * Di, bias=False, dtype=dtype)
        self.conv1d = nn.Conv1d(Di, Di, kernel_size=Kc, groups=Di, padding=Kc - 1, bias=True,
                                dtype=dtype)
        self.act = nn.SiLU()
        self.x_proj = nn.Linear(Di, R + 2 * N, bias=False, dtype=dtype)
        self.dt_proj = nn.Linear(R, Di, bias=True, dtype=dtype)
        self.A_log = nn.Parameter(w["a_log"].to(dtype).clone())
        self.D = nn.Parameter(w["d"].to(dtype).clone())
        self.out_proj = nn.Linear(Di, C, bias=False, dtype=dtype)
        with torch.no_grad():
            self.in_proj.weight.copy_(w["in_proj"].T.to(dtype))
            self.conv1d.weight.copy_(w["conv_w"].view(Di, 1, Kc).to(dtype))
            self.conv1d.bias.copy_(w["conv_b"].to(dtype))
            self.x_proj.weight.copy_(w["x_proj"].T.to(dtype))
            self.dt_proj.weight.copy_(w["dt_proj"].T.to(dtype))
            self.dt_proj.bias.copy_(w["dt_bias"].to(dtype))
            self.out_proj.weight.copy_(w["out_proj"].T.to(dtype))
        for p in self.parameters():
            p.requires_grad_(requires_grad)

    def forward(self, hidden):
        b, l, _ = hidden.shape
        Di, N, R = self.Di, self.N, self.R
        # xz = rearrange(in_proj.weight @ rearrange(hidden, "b l d -> d (b l)"), "d (b l) -> b d l")
        xz = (self.in_proj.weight @ hidden.reshape(b * l, -1).T).reshape(2 * Di, b, l)
        xz = xz.permute(1, 0, 2)
        A = -torch.exp(self.A_log.float())
        x, z = xz.chunk(2, dim=1)                                   # [b, Di, l] each
        x = self.act(self.conv1d(x)[..., :l])
        x_dbl = self.x_proj(x.permute(0, 2, 1).reshape(b * l, Di))  # [(b l), R + 2N]
        dt, Bm, Cm = torch.split(x_dbl, [R, N, N], dim=-1)
        dt = (self.dt_proj.weight @ dt.t()).reshape(Di, b, l).permute(1, 0, 2)  # [b, Di, l]
        Bm = Bm.reshape(b, l, N).permute(0, 2, 1).contiguous()      # [b, N, l]
        Cm = Cm.reshape(b, l, N).permute(0, 2, 1).contiguous()
        y = selective_scan_ref(x, dt, A, Bm, Cm, self.D.float(), z=z,
                               delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
                               literal=self.literal)
        return self.out_proj(y.permute(0, 2, 1))

    def grads_ours_layout(self):
        Di = self.Di
        return {
            "d_in_proj": self.in_proj.weight.grad.T,
            "d_conv_w": self.conv1d.weight.grad.view(Di, -1),
            "d_conv_b": self.conv1d.bias.grad,
            "d_x_proj": self.x_proj.weight.grad.T,
            "d_dt_proj": self.dt_proj.weight.grad.T,
            "d_dt_bias": self.dt_proj.bias.grad,
            "d_a_log": self.A_log.grad,
            "d_d": self.D.grad,
            "d_out_proj": self.out_proj.weight.grad.T,
        }


def torch_call(block, x, dy, bwd, keep=False):
    """One call. With keep, returns the outputs (y; dx and parameter gradients for bwd)."""
    if not bwd:
        with torch.no_grad():
            y = block(x)
        out = {"y": y} if keep else None
        del y
        return out
    x.grad = None
    for p in block.parameters():
        p.grad = None
    y = block(x)
    y.backward(dy)
    out = None
    if keep:
        out = {"y": y.detach(), "dx": x.grad}
        out.update(block.grads_ours_layout())
    del y
    x.grad = None
    if not keep:
        for p in block.parameters():
            p.grad = None
    return out


def as_rows(t):
    t = t.detach()
    return t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1)


def run_torch(inputs, T, C, prec, bwd, reps, literal=False):
    dtype = DTYPES[prec]
    block = TorchMamba(inputs, C, dtype, requires_grad=bwd, literal=literal)
    x = inputs["x"].to(dtype).view(1, T, C).requires_grad_(bwd)
    dy = inputs["dy"].to(dtype).view(1, T, C)
    torch_call(block, x, dy, bwd)  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch_call(block, x, dy, bwd)
        best = min(best, (time.perf_counter() - t0) * 1e3)
    outputs, rss = rss_growth(lambda: torch_call(block, x, dy, bwd, keep=True))
    outputs = {k: as_rows(v).clone() for k, v in outputs.items()}
    del block, x, dy
    return best, rss, outputs


def reference_f64(inputs, T, C, prec):
    """out, dx and the nine gradients in float64 from the inputs rounded to prec (then exact)."""
    dtype = DTYPES[prec]
    rounded = {k: v.to(dtype).to(torch.float64) for k, v in inputs.items()}
    block = TorchMamba(rounded, C, torch.float64, requires_grad=True)
    x = rounded["x"].view(1, T, C).requires_grad_(True)
    out = torch_call(block, x, rounded["dy"].view(1, T, C), bwd=True, keep=True)
    return {k: as_rows(v) for k, v in out.items()}


# ---- Ours, through the runner -------------------------------------------------------------------
def raw_bytes(t):
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def out_shapes(T, C):
    Di, N, Kc, R = dims(C)
    return [("dx", T, C), ("d_in_proj", C, 2 * Di), ("d_conv_w", Di, Kc), ("d_conv_b", 1, Di),
            ("d_x_proj", Di, R + 2 * N), ("d_dt_proj", R, Di), ("d_dt_bias", 1, Di),
            ("d_a_log", Di, N), ("d_d", 1, Di), ("d_out_proj", Di, C)]


def run_ours(runner, tmp, inputs, T, C, prec, bwd, reps, threads, chunk):
    dtype = DTYPES[prec]
    Di, N, Kc, R = dims(C)
    path_in, path_out = os.path.join(tmp, "in.bin"), os.path.join(tmp, "out.bin")
    with open(path_in, "wb") as f:
        f.write(struct.pack("<8Q", 1, T, C, Di, N, Kc, R, DTYPE_CODE[prec]))
        for name in ("x",) + WEIGHTS + ("dy",):
            f.write(raw_bytes(inputs[name].to(dtype)))
    cmd = [runner, path_in, path_out, "--prec", prec, "--pass", "fwdbwd" if bwd else "fwd",
           "--chunk", str(chunk), "--reps", str(reps), "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(path_out, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=dtype)
    shapes = [("y", T, C)] + (out_shapes(T, C) if bwd else [])
    outputs, at = {}, 0
    for name, r, c in shapes:
        outputs[name] = data[at:at + r * c].view(r, c).clone()
        at += r * c
    if at != data.numel():
        raise RuntimeError(f"runner wrote {data.numel()} elements, expected {at}")
    return stats, outputs


# ---- Driver -------------------------------------------------------------------------------------
def make_inputs(T, C):
    torch.manual_seed(0)
    Di, N, Kc, R = dims(C)

    def u(shape, bound):
        return (torch.rand(shape) * 2 - 1) * bound

    dt = torch.exp(torch.rand(Di) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
    return {
        "x": torch.randn(T, C),
        "in_proj": u((C, 2 * Di), C ** -0.5),
        "conv_w": u((Di, Kc), Kc ** -0.5),
        "conv_b": u((Di,), Kc ** -0.5),
        "x_proj": u((Di, R + 2 * N), Di ** -0.5),
        "dt_proj": u((R, Di), R ** -0.5),
        "dt_bias": dt + torch.log(-torch.expm1(-dt)),
        "a_log": torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(Di, 1)
        + u((Di, N), 0.1),
        "d": 1 + u((Di,), 0.2),
        "out_proj": u((Di, C), Di ** -0.5),
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runner", required=True, help="path of mamba_peer_runner")
    ap.add_argument("--shapes", choices=("quick", "all"), default="quick")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=256, choices=(64, 128, 256))
    ap.add_argument("--no-bf16", action="store_true", help="fp32 rows only")
    ap.add_argument("--literal", action="store_true",
                    help="index the scan's steps as upstream does ([:, :, i]) instead of through "
                         "unbind: quadratic in T backward (minutes at T = 1024)")
    ap.add_argument("--check-shape", default=None,
                    help="T,C of the output check (default 1024,256)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    seqs = (1024,) if args.shapes == "quick" else (1024, 4096)
    models = (256, 768)
    precs = ("fp32",) if args.no_bf16 else ("fp32", "bf16")
    check = tuple(int(v) for v in args.check_shape.split(",")) if args.check_shape else (1024, 256)

    print(f"torch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}),"
          f" {args.threads} threads (torch.set_num_threads and ours), best of {args.reps}")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs")
    print(f"B=1, Di=2C, Ns={NS}, K={K}, R=ceil(C/16); ours: recompute, scan_chunk<{args.chunk}>; "
          "torch: Mamba.forward's reference path (selective_scan_ref, steps "
          f"{'indexed [:, :, i]' if args.literal else 'through unbind'}), fwd under no_grad; "
          "RSS = peak RSS growth of one call (outputs included)\n")
    print("| T | C | prec | pass | ours ms | torch ms | torch/ours | ours alloc MiB | ours RSS MiB"
          " | torch RSS MiB | torch/ours mem | outputs MiB |")
    print("|--:|--:|---|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    sys.stdout.flush()

    checked = {}  # (prec, pass) -> (ours outputs, torch outputs)
    with tempfile.TemporaryDirectory(prefix="mamba_peer_") as tmp:
        for C in models:
            for T in seqs:
                inputs = make_inputs(T, C)
                for prec in precs:
                    for bwd in (False, True):
                        stats, ours_out = run_ours(args.runner, tmp, inputs, T, C, prec, bwd,
                                                   args.reps, args.threads, args.chunk)
                        t_ms, t_rss, torch_out = run_torch(inputs, T, C, prec, bwd, args.reps,
                                                           args.literal)
                        if (T, C) == check:
                            checked[(prec, bwd)] = (ours_out, torch_out)
                        o_rss = stats["peak_rss_bytes"]
                        print(f"| {T} | {C} | {prec} | {'fwd+bwd' if bwd else 'fwd'} "
                              f"| {stats['ms']:.1f} | {t_ms:.1f} | {t_ms / stats['ms']:.2f} "
                              f"| {stats['peak_alloc_bytes'] / MiB:.1f} | {o_rss / MiB:.1f} "
                              f"| {t_rss / MiB:.1f} "
                              f"| {t_rss / o_rss if o_rss else float('inf'):.2f} "
                              f"| {stats['output_bytes'] / MiB:.1f} |")
                        sys.stdout.flush()
                        del ours_out, torch_out

    if not checked:
        print(f"\nno output check: T,C = {check} is not in the set")
        return 1
    T, C = check
    print(f"\nOutput check, T={T} C={C}: max|got - f64| / max|f64|, f64 = the same block in "
          "PyTorch float64 (autograd for the gradients) on the same inputs (bf16: the "
          "bf16-rounded inputs)\n")
    print("| prec | pass | tensor | ours | torch | tol (ours) |")
    print("|---|---|---|--:|--:|--:|")
    ok = True
    inputs = make_inputs(T, C)
    for prec in precs:
        ref = reference_f64(inputs, T, C, prec)
        for bwd in (False, True):
            if (prec, bwd) not in checked:
                continue
            ours_out, torch_out = checked[(prec, bwd)]
            for name, got in ours_out.items():
                want = ref[name].reshape(got.shape)
                e_ours = rel_err(got, want)
                e_torch = rel_err(torch_out[name].reshape(got.shape), want)
                bad = not e_ours <= TOL[prec]
                ok &= not bad
                print(f"| {prec} | {'fwd+bwd' if bwd else 'fwd'} | {name} | {e_ours:.2e} "
                      f"| {e_torch:.2e} | {TOL[prec]:g}{' FAIL' if bad else ''} |")
    print(f"\noutput check: {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
