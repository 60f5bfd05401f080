#!/usr/bin/env python3
"""Our TTT-Linear and TTT-MLP layers against the same layers in PyTorch on the CPU.

They follow ttt-lm-pytorch's TTTLinear and TTTMLP algorithms; same shapes, same inputs, same
thread count, one run. A tool to run and report, not part of ctest.

Build the runner and run (from the repository root; the PyTorch here is /tmp/torchenv):

    cmake -S . -B /tmp/peer-build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
          -DMEMBOUND_BUILD_TESTS=OFF -DMEMBOUND_ENABLE_CUDA=OFF
    cmake --build /tmp/peer-build --target ttt_peer_runner
    /tmp/torchenv/bin/python bench/peers/ttt_peer.py \\
          --runner /tmp/peer-build/bench/ttt_peer_runner --kind both --shapes quick
    /tmp/torchenv/bin/python bench/peers/ttt_peer.py \\
          --runner /tmp/peer-build/bench/ttt_peer_runner --kind both --shapes all --reps 3

--kind linear|mlp|both (default both): which layers, one table and one output check each.
Shapes: B = 1, width C = 512, H = 8 heads (D = 64), mini-batch b = 16, no gate, fp32;
T = 1024 (quick) or T in {1024, 4096} (all); TTT-MLP's hidden width F = 4D = 256. Per kind and
T: forward, and forward+backward with the state group G (mini-batches per saved inner state) in
{1, 4, all} on both sides.

The PyTorch TTT-Linear layer follows upstream's TTTLinear (test-time-training/ttt-lm-pytorch,
ttt.py) as it computes a training step, without share_qk / pre_conv, built the way
ttt_reference_check.py builds it (which checks that construction against our double reference to
1e-10) and reusing its ln_fwd, ln_fused_l2_bwd and RoPE permutation helpers: bias-free q/k/v/o
projections (nn.Linear, weight = our W transposed); RoPE at position t mod b with cos/sin computed
in float32 as upstream's RotaryEmbedding does, applied between permute_qk and undo_permute_qk; the
sequence reshaped into [B, H, T/b, b, D] mini-batches; get_eta for all mini-batches at once (einsum
of x with the per-head rate weights, sigmoid, base_lr/D, times the clamped token_idx +
learnable_token_idx); then upstream's scan over mini-batches of compute_mini_batch in the DUAL form
(Z1 = XK·W1 + b1, the LayerNorm-fused L2 gradient, tril(XQ·XKᵀ), Z1_bar, the last row of eta
updating W1, b1; the carry also holds upstream's zero W1_grad / b1_grad), each mini-batch's output
written into a preallocated [T/b, B, H, b, D] tensor; post_norm LayerNorm (eps 1e-6); o_proj.
Backward is autograd through all of it.
The PyTorch TTT-MLP layer is the same module with upstream's TTTMLP compute_mini_batch in the
dual form: W1 [H, D, 4D], b1 [H, 1, 4D], W2 [H, 4D, D], b2 [H, 1, D]; per mini-batch, at its
starting (W1, b1, W2, b2): Z1 = XK·W1 + b1, X2 = gelu_tanh(Z1), Z2 = X2·W2 + b2, grad_Z2 the
LayerNorm-fused L2 gradient, grad_Z1 = grad_Z2·W2ᵀ ⊙ gelu_bwd(Z1) (upstream's gelu_bwd with its
rounded constants 0.79788456 / 0.1070322243; ours uses the exact sqrt(2/π), ~1e-9 relative in
gelu', far below fp32 rounding); the first layer in the dual form (b1_bar, tril(XQ·XKᵀ), Z1_bar),
then X2_bar = gelu(Z1_bar) and the second layer in the dual form (b2_bar, tril(X2_bar·X2ᵀ),
Z2_bar); the last row of eta updates W1, b1, W2, b2; the carry holds upstream's zero
W*_grad / b*_grad too; out = XQ + LN(Z2_bar). ttt_reference_check.py checks the same
construction (in float64) against our double reference for both kinds.
Checkpointing as upstream: scan() wraps runs of mini-batches in torch.utils.checkpoint
(use_reentrant=False). Upstream's code computes ckpt_every_n = num_mini_batches //
scan_checkpoint_group_size, i.e. its argument counts GROUPS (its docstring says group size); we
pass num_mini_batches // G so that every checkpoint covers G mini-batches, as ours does with
ttt_state_groups<G> (G = all: one checkpoint around the whole scan). "fwd" runs PyTorch in
eval() under torch.no_grad() (upstream disables the checkpointing outside training; inference
keeps nothing for backward, its best case; ours still writes what backward needs); "fwdbwd" runs
y = layer(x) in train() with x and every parameter requiring grad, then y.backward(dy), x.grad and
every .grad set to None before the call.

Inputs, drawn in float32 from torch.manual_seed(0) for each T: x, dy ~ N(0, 1); every weight
U(±s), s = 0.5/sqrt(C), except ttt_norm_weight and post_norm.weight 1 + U(±s), W1 U(±2s) and the
rate weights U(±4s) (so that test-time learning changes the output), rate biases U(±0.5), token
offsets U(±0.2); TTT-MLP's W1 is [H, D, 4D] (U(±2s) too), its W2 and b2 U(±s), drawn after the
others (the TTT-Linear inputs are the same as before TTT-MLP was added). Each row writes them once
to a raw file (format in ttt_peer_runner.cpp; word 6 of its header is the kind) and runs two fresh
processes on it: the runner (ours) and this script with --torch-child (PyTorch), which take the
same arguments, measure the same way and write their outputs back in the same raw format.
Fresh processes keep one row's heap state (and glibc's malloc thresholds) out of the next row.

Columns:
  ours ms, torch ms     best of --reps wall times of one call, after one warm-up, both on
                        --threads threads (torch.set_num_threads; ours: a thread_pool).
  torch/ours            torch ms / ours ms: our speed-up.
  ours alloc MiB        our allocator statistics' peak over one call (saved + workspace): the
                        layer's own memory beyond inputs, outputs, weights and gradients.
  ours RSS MiB,         peak RSS growth over one call after the timed ones, the same method on
  torch RSS MiB         both sides: mallopt(M_MMAP_THRESHOLD, 128 KiB) (glibc otherwise raises its
                        threshold as large buffers are freed and keeps freed buffers of up to
                        32 MiB in the heap, resident), malloc_trim(0), write "5" to
                        /proc/self/clear_refs (resets VmHWM to the current RSS), read VmRSS, run
                        one call that allocates its outputs (y; for fwdbwd also dx and the 13
                        (TTT-Linear) or 15 (TTT-MLP) parameter gradients), read VmHWM; report
                        VmHWM - VmRSS before. Both include the outputs (column "outputs MiB");
                        neither includes inputs and weights, which exist before. Memory an
                        allocator kept from earlier calls and reuses is resident already and not
                        counted, on either side.
  torch/ours mem        torch RSS / ours RSS.
The load average is printed at the start and the end: the timings are only as good as the
machine is quiet.

--device cuda: PyTorch alone on the GPU, for the issue's ratio against our device layers
(bench/bench_cuda_ttt.cu, which times ours at the same shapes): B = 1, C = 1024, H = 16 (D = 64),
b = 16, T = 2048 (quick) or {2048, 8192} (all), the same module in fp32 weights under
torch.autocast("cuda", dtype=torch.bfloat16), forward (eval, no_grad) and forward+backward
(train) with G = 4 (all: also 1 and all); best of --reps, each call between
torch.cuda.synchronize(); peak MiB = torch.cuda.max_memory_allocated() over the timed calls minus
what was allocated before them (inputs and weights). With --bench PATH (bench_cuda_ttt built with
CUDA) it also runs ours (--benchmark_format=json, the bf16 rows) and prints tokens/s of both and
ours/torch. No runner and no output check in this mode (the device layers are checked against
the CPU backend by tests/cuda/test_cuda_ttt.cu). Example:

    python bench/peers/ttt_peer.py --device cuda --kind both --shapes all \
          --bench build/gpu/bench/bench_cuda_ttt

OpenMP wait policy: the PyTorch child runs with OMP_WAIT_POLICY=PASSIVE unless the environment
sets it (the value used is printed). PyTorch parallelizes each small op of the per-mini-batch loop
over its OpenMP team; on a shared machine whose cores are busy with other work, a worker that
spins at the barrier while its partner is descheduled makes every op wait for a time slice. On
the 2-core machine this was written on (load average ~4), the PyTorch forward at T = 1024 took
7.8 s with the default policy, 0.66 s with ACTIVE, 0.16 s with PASSIVE and 0.13 s on 1 thread.
On a quiet machine the policy should matter much less (not measured: none was available);
--threads 1 sidesteps the question on both sides.

Output check, per kind (T = 1024 unless --check-t says otherwise; every row of that T): the same
PyTorch layer in float64 (no checkpointing) on the same inputs gives y and, through autograd, dx
and the 13 (TTT-Linear) or 15 (TTT-MLP: also W2, b2) parameter gradients. For each tensor we
print max|got - f64| / max|f64| for ours and for PyTorch's own fp32 layer, as context. Exit
status 1 when ours exceeds 2e-4 for either kind. Why 2e-4: both sides
are fp32 with different summation orders on O(1) values. The projections and weight gradients sum
over C = 512 or T = 1024 terms (rounding ~sqrt(n)·2^-24 ≈ 1e-6 relative). The inner state is
carried through T/b = 64 mini-batch updates, every one of its rounding errors reaches all later
tokens, and the inner LayerNorm divides by σ of Z1 (rows of D = 64), which can amplify them. The
token offsets' gradient is a sum over all B·H·T/b mini-batch rows of products that largely
cancel, so its relative error can be the largest. Measured: ≤ 1.5e-6 on every tensor here, ours
and PyTorch's fp32 alike; bench_ttt.cpp's check of its naive fp32 layer against ours (T = 256,
other inputs) shows ≤ 1.4e-6 on all but the token offsets, 1.2e-5 there. TTT-MLP measured
(T = 1024): ≤ 1.9e-6 on every tensor for ours, ≤ 1e-6 for PyTorch's fp32 layer; bench_ttt.cpp's
naive fp32 TTT-MLP against ours (T = 256): ≤ 4.8e-6. 2e-4 leaves a >10x margin over the worst
fp32-vs-fp32 disagreement seen; a real error (a wrong sign, a missing term, a state carried
wrongly across a state group) is O(1e-2) or more (dropping only the GELU's second-derivative
term in bench_ttt.cpp's naive TTT-MLP backward moves its W1 gradient by 5.7e-3).
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
import torch.nn as nn  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ttt_reference_check import (  # noqa: E402
    from_halves, gelu_bwd, ln_fused_l2_bwd, ln_fwd, rotate_half, to_halves)

H, C, MB = 8, 512, 16
D = C // H
ROPE_BASE = 10000.0
BASE_LR = 1.0
TOL = 2e-4
MiB = float(1 << 20)
GROUPS = ("1", "4", "all")
KINDS = ("linear", "mlp")
KIND_CODE = {"linear": 0, "mlp": 1}  # word 6 of IN's header


def weights_of(kind):
    """Ours' weights order (basic_ttt::weights, no gate) and shapes: the inner model is W1 [D, F],
    b1 [F] (F = D linear, 4D mlp), and for mlp W2 [F, D], b2 [D] after wo."""
    Fh = 4 * D if kind == "mlp" else D
    w = (("wq", (C, C)), ("wk", (C, C)), ("wv", (C, C)), ("ttt_norm_w", (H, D)),
         ("ttt_norm_b", (H, D)), ("w1", (H, D, Fh)), ("b1", (H, Fh)), ("lr_w", (H, C)),
         ("lr_b", (H,)), ("tok_offset", (MB,)), ("post_w", (C,)), ("post_b", (C,)),
         ("wo", (C, C)))
    return w + ((("w2", (H, Fh, D)), ("b2", (H, D))) if kind == "mlp" else ())


def output_names(kind):
    return ("y", "dx") + tuple("d_" + n for n, _ in weights_of(kind))

libc = ctypes.CDLL("libc.so.6")
M_MMAP_THRESHOLD = -3  # <malloc.h>


# ---- Peak RSS growth of one call --------------------------------------------------------------
def proc_status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def rss_growth(fn):
    """Runs fn() once; returns (its result, VmHWM after - VmRSS before)."""
    libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = proc_status_bytes("VmRSS")
    result = fn()
    hwm = proc_status_bytes("VmHWM")
    return result, max(0, hwm - before)


# ---- The PyTorch layer --------------------------------------------------------------------------
def scan(f, init, xs, out, checkpoint_group=0):
    """Upstream's scan (a jax.lax.scan look-alike): f over xs[i] carrying `carry`, out[i] = y.
    checkpoint_group > 0 wraps every num_items // checkpoint_group steps in one
    torch.utils.checkpoint (use_reentrant=False), as upstream does."""
    carry = init
    num_items = len(next(iter(xs.values())))

    def scan_fn(carry, i_start, i_end):
        for i in range(i_start, i_end):
            carry, y = f(carry, {key: t[i] for key, t in xs.items()})
            out[i] = y
        return carry

    if checkpoint_group > 0:
        every = num_items // checkpoint_group
        for k in range(0, num_items, every):
            carry = torch.utils.checkpoint.checkpoint(scan_fn, carry, k,
                                                      min(k + every, num_items),
                                                      use_reentrant=False)
    else:
        carry = scan_fn(carry, 0, num_items)
    return carry, out


def linear(w_in_out, dtype):
    lin = nn.Linear(w_in_out.shape[0], w_in_out.shape[1], bias=False, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(w_in_out.T.to(dtype))
    return lin


class TorchTTT(nn.Module):
    """TTTLinear's (kind "linear") or TTTMLP's (kind "mlp") training forward (dual form, scan
    over mini-batches); weights from our layout."""

    def __init__(self, w, dtype, group, kind="linear"):
        super().__init__()
        self.group = group  # mini-batches per checkpoint: 0 none, "all" the whole scan
        self.mlp = kind == "mlp"
        Fh = 4 * D if self.mlp else D
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            linear(w[n], dtype) for n in ("wq", "wk", "wv", "wo"))
        p = lambda t, *shape: nn.Parameter(t.to(dtype).reshape(*shape).clone())  # noqa: E731
        self.learnable_ttt_lr_weight = p(w["lr_w"], H, 1, C)
        self.learnable_ttt_lr_bias = p(w["lr_b"], H, 1)
        # upstream: a float32 buffer 1/(i+1); the float64 reference holds it in float64
        self.register_buffer("token_idx", 1.0 / torch.arange(1, MB + 1, dtype=dtype))
        self.learnable_token_idx = p(w["tok_offset"], MB)
        self.ttt_norm_weight = p(w["ttt_norm_w"], H, D)
        self.ttt_norm_bias = p(w["ttt_norm_b"], H, D)
        self.post_norm = nn.LayerNorm(C, eps=1e-6, dtype=dtype)
        with torch.no_grad():
            self.post_norm.weight.copy_(w["post_w"].to(dtype))
            self.post_norm.bias.copy_(w["post_b"].to(dtype))
        self.W1 = p(w["w1"], H, D, Fh)
        self.b1 = p(w["b1"], H, 1, Fh)
        self.inner = ("W1", "b1")
        if self.mlp:
            self.W2 = p(w["w2"], H, Fh, D)
            self.b2 = p(w["b2"], H, 1, D)
            self.inner += ("W2", "b2")

    def rope(self, q, k, T):
        """Upstream's RotaryEmbedding (float32 cos/sin at position t mod b) and its
        permute_qk / apply_rotary_pos_emb / undo_permute_qk; q, k [B, H, T, D]. The float64
        reference computes cos/sin in float64."""
        ft = torch.float64 if q.dtype == torch.float64 else torch.float32
        dev = q.device
        inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, D, 2, dtype=torch.int64, device=dev).to(ft)
                                        / D))
        positions = (torch.arange(T, device=dev) % MB).to(ft)
        freqs = positions[:, None] * inv_freq[None, :]                  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q, k = to_halves(q), to_halves(k)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return from_halves(q), from_halves(k)

    def compute_mini_batch(self, params, inputs):
        """One mini-batch in the dual form, [B, H, K, D] rows, eta [B, H, K, K]."""
        if self.mlp:
            return self.compute_mini_batch_mlp(params, inputs)
        W1_init, b1_init = params["W1_states"], params["b1_states"]
        XQ, XK, XV, eta = inputs["XQ"], inputs["XK"], inputs["XV"], inputs["eta"]
        Z1 = XK @ W1_init + b1_init
        target = XV - XK
        ln_w = self.ttt_norm_weight.reshape(H, 1, D)
        ln_b = self.ttt_norm_bias.reshape(H, 1, D)
        grad_Z1 = ln_fused_l2_bwd(Z1, target, ln_w, ln_b, 1e-6)
        Attn1 = torch.tril(XQ @ XK.transpose(-2, -1))
        b1_bar = b1_init - torch.tril(eta) @ grad_Z1
        Z1_bar = XQ @ W1_init - (eta * Attn1) @ grad_Z1 + b1_bar
        last_eta = eta[:, :, -1, :, None]
        W1_last = W1_init - (last_eta * XK).transpose(-1, -2) @ grad_Z1
        b1_last = b1_init - torch.sum(last_eta * grad_Z1, dim=-2, keepdim=True)
        out = XQ + ln_fwd(Z1_bar, ln_w, ln_b, 1e-6)
        return {"W1_states": W1_last, "b1_states": b1_last,
                "W1_grad": torch.zeros_like(W1_last), "b1_grad": torch.zeros_like(b1_last)}, out

    def compute_mini_batch_mlp(self, params, inputs):
        """TTTMLP's compute_mini_batch, dual form: the gradients at the mini-batch's (W1, b1, W2,
        b2) (grad_Z2 from the LayerNorm-fused L2 loss, grad_Z1 = grad_Z2·W2ᵀ ⊙ gelu_bwd(Z1) with
        upstream's gelu_bwd constants), the first layer's Z1_bar through tril(XQ·XKᵀ), then
        X2_bar = gelu(Z1_bar) and the second layer's Z2_bar through tril(X2_bar·X2ᵀ); the last
        row of eta updates all four; the carry holds upstream's zero W*_grad / b*_grad."""
        W1_init, b1_init = params["W1_states"], params["b1_states"]
        W2_init, b2_init = params["W2_states"], params["b2_states"]
        XQ, XK, XV, eta = inputs["XQ"], inputs["XK"], inputs["XV"], inputs["eta"]
        X1 = XK
        Z1 = X1 @ W1_init + b1_init
        X2 = torch.nn.functional.gelu(Z1, approximate="tanh")
        Z2 = X2 @ W2_init + b2_init
        target = XV - XK
        ln_w = self.ttt_norm_weight.reshape(H, 1, D)
        ln_b = self.ttt_norm_bias.reshape(H, 1, D)
        grad_Z2 = ln_fused_l2_bwd(Z2, target, ln_w, ln_b, 1e-6)
        grad_Z1 = grad_Z2 @ W2_init.transpose(-2, -1) * gelu_bwd(Z1, True)
        Attn1 = torch.tril(XQ @ X1.transpose(-2, -1))
        b1_bar = b1_init - torch.tril(eta) @ grad_Z1
        Z1_bar = XQ @ W1_init - (eta * Attn1) @ grad_Z1 + b1_bar
        X2_bar = torch.nn.functional.gelu(Z1_bar, approximate="tanh")
        Attn2 = torch.tril(X2_bar @ X2.transpose(-2, -1))
        b2_bar = b2_init - torch.tril(eta) @ grad_Z2
        Z2_bar = X2_bar @ W2_init - (eta * Attn2) @ grad_Z2 + b2_bar
        last_eta = eta[:, :, -1, :, None]
        W1_last = W1_init - (last_eta * X1).transpose(-1, -2) @ grad_Z1
        b1_last = b1_init - torch.sum(last_eta * grad_Z1, dim=-2, keepdim=True)
        W2_last = W2_init - (last_eta * X2).transpose(-1, -2) @ grad_Z2
        b2_last = b2_init - torch.sum(last_eta * grad_Z2, dim=-2, keepdim=True)
        out = XQ + ln_fwd(Z2_bar, ln_w, ln_b, 1e-6)
        new = {"W1_states": W1_last, "b1_states": b1_last,
               "W2_states": W2_last, "b2_states": b2_last}
        for n in self.inner:
            new[n + "_grad"] = torch.zeros_like(new[n + "_states"])
        return new, out

    def forward(self, x):
        B, L, _ = x.shape
        assert L % MB == 0, "the peer writes whole mini-batches only"
        nmb = L // MB
        heads = lambda t: t.reshape(B, L, H, D).transpose(1, 2)  # noqa: E731  [B, H, L, D]
        XQ, XK, XV = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        XQ, XK = self.rope(XQ, XK, L)
        # get_ttt_inputs / get_eta: [B, H, nmb, b, D] rows and eta [B, H, nmb, b, b]
        X = x.reshape(B, nmb, MB, C)
        mbs = lambda t: t.reshape(B, H, nmb, MB, D)  # noqa: E731
        ttt_lr = torch.einsum("bnkc,hdc->bhnkd", X, self.learnable_ttt_lr_weight) \
            + self.learnable_ttt_lr_bias.reshape(1, -1, 1, 1, 1)
        ttt_lr_eta = BASE_LR * torch.sigmoid(ttt_lr).permute(0, 1, 2, 4, 3) / D
        token_idx = torch.clamp_min(self.token_idx + self.learnable_token_idx, 0.0)
        token_eta = torch.broadcast_to(token_idx.reshape(1, 1, 1, MB, 1), (B, H, nmb, MB, 1))
        inputs = {"XQ": mbs(XQ), "XK": mbs(XK), "XV": mbs(XV), "eta": token_eta * ttt_lr_eta}
        inputs = {k: v.permute(2, 0, 1, 3, 4) for k, v in inputs.items()}
        init = {n + "_states": torch.tile(getattr(self, n).unsqueeze(0), dims=(B, 1, 1, 1))
                for n in self.inner}
        for n in self.inner:
            init[n + "_grad"] = torch.zeros_like(init[n + "_states"])
        out = torch.empty((nmb, B, H, MB, D), dtype=x.dtype, device=x.device)
        groups = 0
        if self.training and self.group:
            groups = 1 if self.group == "all" else max(1, nmb // int(self.group))
        _, out = scan(self.compute_mini_batch, init, inputs, out, groups)
        out = out.permute(1, 0, 3, 2, 4).reshape(B, L, C)
        return self.o_proj(self.post_norm(out))

    def grads_ours_layout(self):
        T_ = lambda m: m.weight.grad.T  # noqa: E731  nn.Linear.weight.grad -> our [in, out]
        g = {
            "d_wq": T_(self.q_proj), "d_wk": T_(self.k_proj), "d_wv": T_(self.v_proj),
            "d_ttt_norm_w": self.ttt_norm_weight.grad, "d_ttt_norm_b": self.ttt_norm_bias.grad,
            "d_w1": self.W1.grad, "d_b1": self.b1.grad,
            "d_lr_w": self.learnable_ttt_lr_weight.grad, "d_lr_b": self.learnable_ttt_lr_bias.grad,
            "d_tok_offset": self.learnable_token_idx.grad,
            "d_post_w": self.post_norm.weight.grad, "d_post_b": self.post_norm.bias.grad,
            "d_wo": T_(self.o_proj),
        }
        if self.mlp:
            g.update({"d_w2": self.W2.grad, "d_b2": self.b2.grad})
        return g


def torch_call(layer, x, dy, bwd, keep=False):
    """One call. With keep, returns the outputs (y; dx and parameter gradients for bwd)."""
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
        out.update(layer.grads_ours_layout())
    del y
    x.grad = None
    if not keep:
        for p in layer.parameters():
            p.grad = None
    return out


def raw_bytes(t):
    t = t.detach().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def read_in(path_in, kind):
    with open(path_in, "rb") as f:
        B, T, c, h, mb, gate, kind_code, code = struct.unpack("<8Q", f.read(64))
        if (B, c, h, mb, gate, kind_code, code) != (1, C, H, MB, 0, KIND_CODE[kind], 0):
            raise RuntimeError(f"{path_in}: a shape, kind or dtype this script does not write")
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
    inputs, at = {}, 0
    for name, shape in (("x", (T, C)),) + weights_of(kind) + (("dy", (T, C)),):
        n = 1
        for s in shape:
            n *= s
        inputs[name] = data[at:at + n].view(*shape).clone()
        at += n
    if at != data.numel():
        raise RuntimeError(f"{path_in}: {data.numel()} elements, expected {at}")
    return T, inputs


def torch_child(path_in, path_out, kind, bwd, group, reps, threads):
    """The PyTorch side of one row, in its own process: reads IN, prints one JSON line."""
    torch.set_num_threads(threads)
    T, inputs = read_in(path_in, kind)
    layer = TorchTTT(inputs, torch.float32, group, kind)
    layer.train(bwd)
    for p in layer.parameters():
        p.requires_grad_(bwd)
    x = inputs["x"].view(1, T, C).requires_grad_(bwd)
    dy = inputs["dy"].view(1, T, C)
    torch_call(layer, x, dy, bwd)  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch_call(layer, x, dy, bwd)
        best = min(best, (time.perf_counter() - t0) * 1e3)
    outputs, rss = rss_growth(lambda: torch_call(layer, x, dy, bwd, keep=True))
    with open(path_out, "wb") as f:
        for name in output_names(kind):
            if name in outputs:
                f.write(raw_bytes(outputs[name]))
    print(json.dumps({"ms": best, "peak_rss_bytes": rss, "threads": torch.get_num_threads()}))
    return 0


def reference_f64(inputs, T, kind):
    """y, dx and the 13 (linear) or 15 (mlp) gradients in float64 (no checkpointing) from the
    same inputs."""
    w = {k: v.to(torch.float64) for k, v in inputs.items()}
    layer = TorchTTT(w, torch.float64, 0, kind)
    layer.train(True)
    x = w["x"].view(1, T, C).requires_grad_(True)
    return torch_call(layer, x, w["dy"].view(1, T, C), bwd=True, keep=True)


# ---- Ours, through the runner; the torch child the same way -----------------------------------
def write_in(path_in, inputs, T, kind):
    with open(path_in, "wb") as f:
        f.write(struct.pack("<8Q", 1, T, C, H, MB, 0, KIND_CODE[kind], 0))
        for name in ("x",) + tuple(n for n, _ in weights_of(kind)) + ("dy",):
            f.write(raw_bytes(inputs[name]))


def child_env():
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def run_side(program, path_in, path_out, kind, T, bwd, group, reps, threads):
    """Runs the runner (program = [runner]) or the torch child on IN; returns (JSON, outputs)."""
    cmd = program + [path_in, path_out, "--kind", kind, "--prec", "fp32",
                     "--pass", "fwdbwd" if bwd else "fwd", "--group", group,
                     "--reps", str(reps), "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(path_out, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
    shapes = [("y", (T, C))]
    if bwd:
        shapes += [("dx", (T, C))] + [("d_" + n, s) for n, s in weights_of(kind)]
    outputs, at = {}, 0
    for name, shape in shapes:
        n = 1
        for s in shape:
            n *= s
        outputs[name] = data[at:at + n].clone()
        at += n
    if at != data.numel():
        raise RuntimeError(f"{cmd[0]} wrote {data.numel()} elements, expected {at}")
    return stats, outputs


# ---- Driver -------------------------------------------------------------------------------------
def make_inputs(T, kind):
    torch.manual_seed(0)
    s = 0.5 / C ** 0.5

    def u(shape, bound, offset=0.0):
        return offset + (torch.rand(shape) * 2 - 1) * bound

    inputs = {"x": torch.randn(T, C)}
    scale = {"ttt_norm_w": (s, 1.0), "post_w": (s, 1.0), "w1": (2 * s, 0.0),
             "lr_w": (4 * s, 0.0), "lr_b": (0.5, 0.0), "tok_offset": (0.2, 0.0)}
    for name, shape in weights_of(kind):  # mlp: w2, b2 U(±s), drawn last
        bound, offset = scale.get(name, (s, 0.0))
        inputs[name] = u(shape, bound, offset)
    inputs["dy"] = torch.randn(T, C)
    return inputs


def rel_err(got, want):
    got, want = got.reshape(-1).to(torch.float64), want.detach().reshape(-1)
    diff = (got - want).abs().max().item()
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


def load_average():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runner", help="path of ttt_peer_runner")
    ap.add_argument("--torch-child", nargs=2, metavar=("IN", "OUT"),
                    help="internal: run the PyTorch side of one row on IN (as the runner does)")
    ap.add_argument("--prec", choices=("fp32",), default="fp32", help="with --torch-child")
    ap.add_argument("--pass", dest="pass_", choices=("fwd", "fwdbwd"), help="with --torch-child")
    ap.add_argument("--group", choices=GROUPS, default="4", help="with --torch-child")
    ap.add_argument("--kind", choices=KINDS + ("both",), default="both",
                    help="TTT-Linear, TTT-MLP or both (with --torch-child: linear or mlp)")
    ap.add_argument("--shapes", choices=("quick", "all"), default="quick")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--check-t", type=int, default=1024, help="T of the output check")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: PyTorch alone on the GPU under bf16 autocast (see the docstring)")
    ap.add_argument("--bench", help="with --device cuda: path of bench_cuda_ttt (ours)")
    args = ap.parse_args()
    if args.device == "cuda" and not args.torch_child:
        return device_main(args)
    if args.torch_child:
        if args.kind not in KINDS:
            ap.error("--torch-child needs --kind linear or --kind mlp")
        return torch_child(*args.torch_child, args.kind, args.pass_ == "fwdbwd", args.group,
                           args.reps, args.threads)
    if not args.runner:
        ap.error("--runner is required")

    torch.set_num_threads(args.threads)
    seqs = (1024,) if args.shapes == "quick" else (1024, 4096)
    kinds = KINDS if args.kind == "both" else (args.kind,)
    print(f"torch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}),"
          f" {args.threads} threads (torch.set_num_threads and ours), best of {args.reps}")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; load average at start: "
          f"{load_average()}; torch child OMP_WAIT_POLICY={child_env()['OMP_WAIT_POLICY']}")
    ok = True
    for kind in kinds:
        ok &= run_kind(kind, seqs, args)
    print(f"\nload average at end: {load_average()}")
    print(f"\noutput check ({', '.join(kinds)}): {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


def run_kind(kind, seqs, args):
    """One kind's table and output check; returns whether ours passed the check."""
    name = "TTT-MLP (F = 4D)" if kind == "mlp" else "TTT-Linear"
    print(f"\n{name} B=1 C={C} H={H} D={D} b={MB}, no gate, fp32; G = mini-batches per "
          "state group on both sides (torch: upstream's scan with torch.utils.checkpoint); "
          "torch fwd in eval() under no_grad; RSS = peak RSS growth of one call (outputs "
          "included)\n")
    print("| T | pass | G | ours ms | torch ms | torch/ours | ours alloc MiB | ours RSS MiB"
          " | torch RSS MiB | torch/ours mem | outputs MiB |")
    print("|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    sys.stdout.flush()

    rows = [(False, "4")] + [(True, g) for g in GROUPS]  # ours' fwd does not depend on G
    checked = {}  # (pass, G) -> (ours outputs, torch outputs)
    with tempfile.TemporaryDirectory(prefix="ttt_peer_") as tmp:
        for T in seqs:
            inputs = make_inputs(T, kind)
            path_in = os.path.join(tmp, "in.bin")
            write_in(path_in, inputs, T, kind)
            for bwd, group in rows:
                side = (kind, T, bwd, group, args.reps, args.threads)
                stats, ours_out = run_side([args.runner], path_in, os.path.join(tmp, "ours.bin"),
                                           *side)
                tstats, torch_out = run_side(
                    [sys.executable, os.path.abspath(__file__), "--torch-child"], path_in,
                    os.path.join(tmp, "torch.bin"), *side)
                if T == args.check_t:
                    checked[(bwd, group)] = (ours_out, torch_out)
                o_rss, t_rss = stats["peak_rss_bytes"], tstats["peak_rss_bytes"]
                print(f"| {T} | {'fwd+bwd' if bwd else 'fwd'} | {group if bwd else '—'} "
                      f"| {stats['ms']:.1f} | {tstats['ms']:.1f} | {tstats['ms'] / stats['ms']:.2f} "
                      f"| {stats['peak_alloc_bytes'] / MiB:.1f} | {o_rss / MiB:.1f} "
                      f"| {t_rss / MiB:.1f} | {t_rss / o_rss if o_rss else float('inf'):.2f} "
                      f"| {stats['output_bytes'] / MiB:.1f} |")
                sys.stdout.flush()
                del ours_out, torch_out

    if not checked:
        print(f"\nno output check for {name}: T = {args.check_t} is not in the set")
        return False
    T = args.check_t
    print(f"\n{name} output check, T={T}: max|got - f64| / max|f64|, f64 = the same PyTorch layer "
          "in float64 (no checkpointing; autograd for the gradients) on the same inputs\n")
    print("| pass | G | tensor | ours | torch | tol (ours) |")
    print("|---|--:|---|--:|--:|--:|")
    ok = True
    ref = reference_f64(make_inputs(T, kind), T, kind)
    for (bwd, group), (ours_out, torch_out) in checked.items():
        for tname, got in ours_out.items():
            e_ours, e_torch = rel_err(got, ref[tname]), rel_err(torch_out[tname], ref[tname])
            bad = not e_ours <= TOL
            ok &= not bad
            print(f"| {'fwd+bwd' if bwd else 'fwd'} | {group if bwd else '—'} | {tname} "
                  f"| {e_ours:.2e} | {e_torch:.2e} | {TOL:g}{' FAIL' if bad else ''} |")
    print(f"\n{name} output check: {'ok' if ok else 'FAIL'}")
    sys.stdout.flush()
    return ok


# ---- --device cuda: PyTorch on the GPU under bf16 autocast, next to bench_cuda_ttt -------------
DEVICE_SHAPE = (1024, 16)  # C, H of bench/bench_cuda_ttt.cu


def device_row(kind, T, bwd, group, reps, device):
    """Best ms of one PyTorch call on `device` under bf16 autocast, and the peak bytes allocated
    during the timed calls beyond what existed before them."""
    dev = torch.device(device)
    inputs = make_inputs(T, kind)
    layer = TorchTTT(inputs, torch.float32, group, kind).to(dev)
    layer.train(bwd)
    for p in layer.parameters():
        p.requires_grad_(bwd)
    x = inputs["x"].view(1, T, C).to(dev).requires_grad_(bwd)
    dy = inputs["dy"].view(1, T, C).to(dev)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def call():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            torch_call(layer, x, dy, bwd)

    call()  # warm-up
    sync()
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        call()
        sync()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    return best, peak


def ours_tokens_per_s(bench):
    """{(kind, pass, T): tokens/s} of bench_cuda_ttt's bf16 rows (G = 4), the inner loop on chip."""
    cmd = [bench, "--benchmark_format=json", "--benchmark_filter=bf16_.*/[0-9]+/1/"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    out = {}
    for b in json.loads(proc.stdout)["benchmarks"]:
        if "error_occurred" in b and b["error_occurred"]:
            raise RuntimeError(f"{b['name']}: {b.get('error_message', 'error')}")
        name, T, placement = b["name"].split("/")[:3]  # ttt_<kind>_bf16_<pass>/<T>/<placement>/manual_time
        if placement != "1":
            continue
        kind = "mlp" if name.startswith("ttt_mlp") else "linear"
        pass_ = "fwd+bwd" if name.endswith("forward_backward") else "fwd"
        out[(kind, pass_, int(T))] = b["tokens/s"]
    return out


def device_main(args):
    global C, H, D
    if not torch.cuda.is_available():
        print("--device cuda: no CUDA device visible to torch", file=sys.stderr)
        return 77
    C, H = DEVICE_SHAPE
    D = C // H
    seqs = (2048,) if args.shapes == "quick" else (2048, 8192)
    kinds = KINDS if args.kind == "both" else (args.kind,)
    groups = ("4",) if args.shapes == "quick" else GROUPS
    ours = ours_tokens_per_s(args.bench) if args.bench else {}
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, bf16 autocast, best of "
          f"{args.reps}; ours: {args.bench or '(not run: pass --bench)'}")
    for kind in kinds:
        name = "TTT-MLP (F = 4D)" if kind == "mlp" else "TTT-Linear"
        print(f"\n{name} B=1 C={C} H={H} D={D} b={MB}, no gate\n")
        print("| T | pass | G | torch ms | torch tokens/s | torch peak MiB | ours tokens/s (G=4) "
              "| ours/torch |")
        print("|--:|---|--:|--:|--:|--:|--:|--:|")
        for T in seqs:
            for bwd, group in [(False, "4")] + [(True, g) for g in groups]:
                ms, peak = device_row(kind, T, bwd, group, args.reps, "cuda")
                tps = T / (ms / 1e3)
                pass_ = "fwd+bwd" if bwd else "fwd"
                o = ours.get((kind, pass_, T))
                ratio = f"{o / tps:.2f}" if o and group == "4" else "—"
                print(f"| {T} | {pass_} | {group if bwd else '—'} | {ms:.2f} | {tps:.0f} "
                      f"| {peak / MiB:.1f} | {f'{o:.0f}' if o else '—'} | {ratio} |")
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
