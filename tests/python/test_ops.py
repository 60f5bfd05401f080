"""membound.ops and membound.nn (the layers as torch custom ops) against references outside the
library, in float64 on the CPU:

- TTT-Linear / TTT-MLP against bench/peers/ttt_reference_check.py's TTTLayer, a PyTorch module
  written the way ttt-lm-pytorch's TTTLinear / TTTMLP compute (upstream names and shapes; autograd
  for the gradients), whose checkpoint our modules load as it is;
- the Mamba block against bench/peers/mamba_reference_check.py's MambaBlock (mamba_simple's slow
  path with selective_scan_ref's recurrence), likewise;
- attention against torch's scaled_dot_product_attention with RoPE written here.

Tolerance 1e-10 relative to the largest magnitude: both sides are float64 with different orders
of summation (measured worst ~1e-14). Then torch.autograd.gradcheck on each op (float64 finite
differences), torch.library.opcheck (schema, fake tensors, autograd registration), torch.compile
(fullgraph) over a model of the four modules, bfloat16 against float64, typed errors for bad
input, and 1,000 calls without growth of the process's memory.
"""

from __future__ import annotations

import gc
import os
import pathlib
import sys

import pytest

if os.environ.get("CI"):
    import torch  # CI installs torch (tools/deps.sh): a missing one fails here, never skips
else:
    torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import membound  # noqa: E402
import membound.nn as mnn  # noqa: E402
import membound.ops as ops  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench" / "peers"))
import mamba_reference_check  # noqa: E402
import ttt_reference_check  # noqa: E402

f64 = torch.float64
TOL = 1e-10


def rel(ours: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    return (ours - want).abs().max().item() / (scale if scale > 0 else 1.0)


def random_ttt_case(kind: str, use_gate: bool, B: int, T: int, C: int, H: int, gen: torch.Generator,
                    mini_batch: int = 16) -> dict:
    D = C // H
    Fh = 4 * D if kind == "mlp" else D

    def r(*shape, scale=0.2, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=gen, dtype=f64)).flatten().tolist()

    return {
        "config": {"width": C, "heads": H, "mini_batch": mini_batch, "kind": kind, "use_gate": use_gate, "base_lr": 1.0,
                   "rope_base": 10000.0, "ttt_norm_eps": 1e-6, "post_norm_eps": 1e-6, "batch": B, "seq": T},
        "wq": r(C, C), "wk": r(C, C), "wv": r(C, C), "wo": r(C, C), "wg": r(C, C) if use_gate else [],
        "lr_weight": r(H, C), "lr_bias": r(H), "token_offset": r(mini_batch, scale=0.05),
        "ttt_norm_weight": r(H, D, scale=0.1, shift=1.0), "ttt_norm_bias": r(H, D, scale=0.1),
        "post_norm_weight": r(C, scale=0.1, shift=1.0), "post_norm_bias": r(C, scale=0.1),
        "w1": r(H, D, Fh), "b1": r(H, Fh, scale=0.05),
        "w2": r(H, Fh, D) if kind == "mlp" else [], "b2": r(H, D, scale=0.05) if kind == "mlp" else [],
    }


def upstream_state(module: torch.nn.Module) -> dict:
    """The reference's state dict as ttt-lm-pytorch saves it (token_idx is not persistent upstream)."""
    return {k: v for k, v in module.state_dict().items() if k != "token_idx"}


def backward_pair(ref: torch.nn.Module, ours: torch.nn.Module, x: torch.Tensor, ref_out):
    dy = torch.randn(x.shape, dtype=f64, generator=torch.Generator().manual_seed(7))
    xr, xo = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    yr, yo = ref_out(ref(xr)), ours(xo)
    (yr * dy).sum().backward()
    (yo * dy).sum().backward()
    return yr, yo, xr.grad, xo.grad


# Lengths around the mini-batch b: 1, b - 1, b, b + 1 and several mini-batches with a remainder.
@pytest.mark.parametrize("kind,use_gate,T,b", [("linear", False, 37, 16), ("linear", True, 16, 16),
                                               ("mlp", True, 21, 16), ("mlp", False, 5, 16),
                                               ("linear", False, 1, 1), ("linear", True, 9, 2), ("mlp", False, 3, 4),
                                               ("linear", False, 7, 8), ("mlp", True, 9, 8),
                                               ("linear", True, 70, 32), ("mlp", False, 64, 64),
                                               ("linear", False, 129, 64)])
def test_ttt_equals_the_upstream_style_reference_and_loads_its_checkpoint(kind, use_gate, T, b):
    gen = torch.Generator().manual_seed(11)
    B, C, H = 2, 32, 4
    ref = ttt_reference_check.TTTLayer(random_ttt_case(kind, use_gate, B, T, C, H, gen, b), upstream_gelu=False)
    cls = mnn.TTTMLP if kind == "mlp" else mnn.TTTLinear
    ours = cls(C, H, use_gate=use_gate, mini_batch=b, dtype=f64)
    ours.load_state_dict(upstream_state(ref), strict=True)
    assert set(ours.state_dict()) == set(upstream_state(ref))
    x = torch.randn(B, T, C, dtype=f64, generator=gen)
    yr, yo, dxr, dxo = backward_pair(ref, ours, x, lambda out: out[0])
    assert rel(yo, yr) < TOL
    assert rel(dxo, dxr) < TOL
    for name, p in ref.named_parameters():
        mine = ours.get_parameter(name).grad
        assert mine is not None and rel(mine, p.grad) < TOL, name


def random_mamba_case(C: int, Di: int, N: int, K: int, R: int, gen: torch.Generator) -> dict:
    def r(*shape, scale=0.2, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=gen, dtype=f64)).flatten().tolist()

    return {"config": {"d_model": C, "d_inner": Di, "d_state": N, "d_conv": K, "dt_rank": R},
            "in_proj": r(C, 2 * Di), "conv_w": r(Di, K, scale=0.4), "conv_b": r(Di, scale=0.1),
            "x_proj": r(Di, R + 2 * N), "dt_proj": r(R, Di), "dt_bias": r(Di, scale=0.3, shift=-2.0),
            "a_log": r(Di, N, scale=0.3), "d": r(Di, scale=0.2, shift=1.0), "out_proj": r(Di, C)}


@pytest.mark.parametrize("T", [1, 19, 150])
def test_mamba_equals_the_mamba_simple_reference_and_loads_its_checkpoint(T):
    gen = torch.Generator().manual_seed(5)
    B, C = 2, 24
    ref = mamba_reference_check.MambaBlock(random_mamba_case(C, 48, 16, 4, 2, gen))
    ours = mnn.Mamba(C, dtype=f64)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(B, T, C, dtype=f64, generator=gen)
    yr, yo, dxr, dxo = backward_pair(ref, ours, x, lambda out: out[0])
    assert rel(yo, yr) < TOL and rel(dxo, dxr) < TOL
    for name, p in ref.named_parameters():
        assert rel(ours.get_parameter(name).grad, p.grad) < TOL, name


class SdpaAttention(torch.nn.Module):
    """The reference: Llama-style projections, rotate-half RoPE, SDPA (a band mask for a window)."""

    def __init__(self, ours: mnn.Attention) -> None:
        super().__init__()
        self.m = ours

    def forward(self, x):
        m, (B, T, _) = self.m, x.shape
        H, Hk, D = m.heads, m.kv_heads, m.head_dim
        q = m.q_proj(x).view(B, T, H, D).transpose(1, 2)
        k = m.k_proj(x).view(B, T, Hk, D).transpose(1, 2)
        v = m.v_proj(x).view(B, T, Hk, D).transpose(1, 2)
        inv = 1.0 / (m.rope_base ** (torch.arange(0, D, 2, dtype=f64) / D))
        ang = torch.arange(T, dtype=f64)[:, None] * inv[None, :]
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        half = lambda t: torch.cat((-t[..., D // 2:], t[..., :D // 2]), -1)  # noqa: E731
        q, k = q * cos + half(q) * sin, k * cos + half(k) * sin
        k, v = k.repeat_interleave(H // Hk, dim=1), v.repeat_interleave(H // Hk, dim=1)
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        allowed = torch.ones(T, T, dtype=torch.bool)
        if m.causal:
            allowed &= j <= i
        if m.window:
            allowed &= (i - j).abs() < m.window
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return m.o_proj(o.transpose(1, 2).reshape(B, T, H * D))


@pytest.mark.parametrize("causal,window,kv_heads,head_dim,T", [(True, 0, 2, 8, 70), (False, 0, 4, 16, 33),
                                                               (True, 5, 1, 8, 40), (False, 3, 2, 8, 12)])
def test_attention_equals_sdpa_with_rope(causal, window, kv_heads, head_dim, T):
    torch.manual_seed(3)
    ours = mnn.Attention(32, 4, kv_heads, head_dim, causal=causal, window=window, dtype=f64)
    ref = SdpaAttention(ours)
    x = torch.randn(2, T, 32, dtype=f64)
    dy = torch.randn(2, T, 32, dtype=f64)
    want = []
    for model in (ref, ours):
        ours.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = model(xi)
        (y * dy).sum().backward()
        want.append((y.detach(), xi.grad, [p.grad.clone() for p in ours.parameters()]))
    (yr, dxr, gr), (yo, dxo, go) = want
    assert rel(yo, yr) < TOL and rel(dxo, dxr) < TOL
    assert all(rel(a, b) < TOL for a, b in zip(go, gr))


CASES = {
    "attention": dict(heads=4, kv_heads=2, head_dim=8),
    "mamba": dict(d_inner=32, d_state=4, d_conv=3, dt_rank=2),
    "ttt_linear": dict(heads=2, use_gate=True),
    "ttt_mlp": dict(heads=2),
}


def random_weights(kind, width, scale=0.2, dtype=f64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(*shape, generator=gen, dtype=f64)).to(dtype).requires_grad_(True)
            for _, shape in ops.parameters(kind, width, **CASES[kind])]


@pytest.mark.parametrize("kind", list(CASES))
def test_gradcheck_in_float64(kind):
    x = torch.randn(1, 18, 16, dtype=f64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ws = random_weights(kind, 16)
    f = getattr(ops, kind)
    assert torch.autograd.gradcheck(lambda x, *w: f(x, list(w), **CASES[kind]), (x, *ws), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind,b", [("ttt_linear", 4), ("ttt_mlp", 8)])
def test_gradcheck_in_float64_at_other_mini_batches(kind, b):
    x = torch.randn(1, 2 * b + 3, 16, dtype=f64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    kw = dict(CASES[kind], mini_batch=b)
    gen = torch.Generator().manual_seed(3)
    ws = [(0.5 * torch.randn(*shape, generator=gen, dtype=f64)).requires_grad_(True)
          for _, shape in ops.parameters(kind, 16, **kw)]
    f = getattr(ops, kind)
    assert torch.autograd.gradcheck(lambda x, *w: f(x, list(w), **kw), (x, *ws), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", list(CASES))
def test_opcheck(kind):
    fwd, bwd = ops._OPS[kind]
    names = ops._ATTRS[kind]
    x = torch.randn(2, 9, 16, dtype=f64, requires_grad=True)
    ws = random_weights(kind, 16)
    attrs = [CASES[kind].get(n, v) for n, v in zip(names, _defaults(kind))]
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(fwd, (x, ws, None, *attrs), test_utils=checks)
    # Inputs with other strides (nn.Linear weights arrive transposed): the fakes' outputs are
    # contiguous as the real ones are.
    x_t = x.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(True)
    ws_t = [w.detach().t().contiguous().t().requires_grad_(True) if w.dim() == 2 else w for w in ws]
    assert not x_t.is_contiguous() and any(not w.is_contiguous() for w in ws_t)
    torch.library.opcheck(fwd, (x_t, ws_t, None, *attrs), test_utils=checks)
    y, saved = fwd(x, ws, None, *attrs)
    assert saved.numel() == ops.sizes(kind, x.shape, f64, **CASES[kind])["saved"] + 256
    torch.library.opcheck(bwd, (x.detach(), [w.detach() for w in ws], None, saved, torch.randn_like(y), *attrs),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(bwd, (x_t.detach(), [w.detach() for w in ws_t], None, saved, torch.randn_like(y), *attrs),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("kind", ["ttt_linear", "ttt_mlp"])
def test_opcheck_at_another_mini_batch(kind):
    kw = dict(CASES[kind], mini_batch=4)
    attrs = [kw.get(n, v) for n, v in zip(ops._ATTRS[kind], _defaults(kind))]
    gen = torch.Generator().manual_seed(5)
    ws = [(0.3 * torch.randn(*shape, generator=gen, dtype=f64)).requires_grad_(True)
          for _, shape in ops.parameters(kind, 16, **kw)]
    x = torch.randn(2, 9, 16, dtype=f64, requires_grad=True)
    # Not test_aot_dispatch_dynamic: it compares every output's values, and the saved bytes hold
    # address-dependent padding; test_torch_compile_with_dynamic_shapes_traces_once compares y and
    # the gradients instead.
    torch.library.opcheck(ops._OPS[kind][0], (x, ws, None, *attrs),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("kind", list(CASES))
def test_saved_bytes_survive_a_hook_that_moves_them(kind):
    """saved_tensors_hooks (and save_on_cpu, offloading hooks) copy saved tensors elsewhere: the
    copy here lands 64 bytes past a 256-byte boundary, so the layer's bytes must be found again."""
    x = torch.randn(2, 21, 16, dtype=f64, generator=torch.Generator().manual_seed(4))
    f = getattr(ops, kind)

    def grads(hooked):
        ws = random_weights(kind, 16)
        xi = x.clone().requires_grad_(True)

        def pack(t):
            if not hooked or t.dtype != torch.uint8:
                return t
            buf = torch.empty(t.numel() + 512, dtype=torch.uint8)
            at = (-buf.data_ptr() % 256) + 64
            moved = buf[at:at + t.numel()]
            moved.copy_(t)
            return moved

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = f(xi, ws, **CASES[kind])
        (y * y).sum().backward()
        return [xi.grad] + [w.grad for w in ws]

    for got, want in zip(grads(True), grads(False)):
        assert torch.equal(got, want)


def test_parameters_and_sizes_take_the_ops_defaults():
    assert ops.parameters("attention", 16, heads=4) == [("wq", [16, 16]), ("wk", [16, 16]), ("wv", [16, 16]),
                                                        ("wo", [16, 16])]
    assert ops.parameters("mamba", 32)[0] == ("in_proj", [32, 128]) and ops.parameters("mamba", 32)[4] == (
        "dt_proj", [2, 64])
    assert ops.sizes("mamba", (1, 8, 32))["saved"] > 0


def _defaults(kind):
    return {"attention": (4, 4, 4, True, 0, 10000.0), "mamba": (32, 16, 4, 1),
            "ttt_linear": (2, False, 1.0, 10000.0, 16), "ttt_mlp": (2, False, 1.0, 10000.0, 16)}[kind]


class Hybrid(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.layers = torch.nn.ModuleList([mnn.TTTLinear(32, 4, dtype=dtype), mnn.Attention(32, 4, 2, dtype=dtype),
                                           mnn.Mamba(32, dtype=dtype), mnn.TTTMLP(32, 2, dtype=dtype)])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_torch_compile_traces_the_ops_in_one_graph():
    torch.manual_seed(0)
    model = Hybrid(f64)
    x = torch.randn(2, 24, 32, dtype=f64)
    eager = model(x)
    eager.square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for backend in ("aot_eager", "inductor"):  # inductor: the default, with its own C++ kernels around ours
        torch._dynamo.reset()
        model.zero_grad()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        y = compiled(x)
        y.square().sum().backward()
        assert rel(y.detach(), eager.detach()) < 1e-12, backend
        assert all(rel(p.grad, g) < 1e-11 for p, g in zip(model.parameters(), eager_grads)), backend


def _compiled_and_eager(model, compiled, x):
    """(y, gradients) of the compiled model and of the eager one, each from zeroed gradients."""
    out = []
    for f in (compiled, model):
        model.zero_grad()
        y = f(x)
        y.square().sum().backward()
        out.append((y.detach(), [p.grad.clone() for p in model.parameters()]))
    return out


def test_torch_compile_with_dynamic_shapes_traces_once():
    """dynamic=True: one graph for every batch and length (the saved bytes are an unbacked size in
    the trace; each eager call still allocates the layer's exact bytes)."""
    torch.manual_seed(0)
    model = Hybrid(f64)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting, dynamic=True, fullgraph=True)
    for B, T in ((2, 24), (3, 40), (2, 7), (4, 100)):
        (y, got), (want, grads) = _compiled_and_eager(model, compiled, torch.randn(B, T, 32, dtype=f64))
        assert torch.equal(y, want)
        assert all(torch.equal(g, h) for g, h in zip(got, grads))
    assert len(graphs) == 1
    for backend in ("aot_eager", "inductor"):  # autograd through the unbacked size, and inductor's code
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
        for B, T in ((2, 24), (3, 41)):
            (y, got), (want, grads) = _compiled_and_eager(model, compiled, torch.randn(B, T, 32, dtype=f64))
            assert rel(y, want) < 1e-12, backend
            assert all(rel(g, h) < 1e-11 for g, h in zip(got, grads)), backend
    # A bad call fails while tracing, with membound's message (the fake checks the arguments on a
    # concrete stand-in shape), not later inside the compiled graph.
    torch._dynamo.reset()
    ws = [torch.zeros(*shape, dtype=f64) for _, shape in ops.parameters("ttt_linear", 32, heads=4)]
    bad = torch.compile(lambda x: ops.ttt_linear(x, ws, heads=4), dynamic=True, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="shape.width"):
        bad(torch.randn(2, 9, 30, dtype=f64))


@pytest.mark.parametrize("kind", list(CASES))
def test_bfloat16_follows_float64(kind):
    x64 = torch.randn(2, 20, 16, dtype=f64, generator=torch.Generator().manual_seed(2))
    w64 = random_weights(kind, 16)
    f = getattr(ops, kind)
    want = f(x64, w64, **CASES[kind])
    wb = [w.detach().to(torch.bfloat16).requires_grad_(True) for w in w64]
    got = f(x64.to(torch.bfloat16), wb, **CASES[kind])
    assert got.dtype == torch.bfloat16
    # bf16 keeps 8 significant bits: inputs, weights and y each round once at 2^-9 relative, and
    # the layers' stored intermediates (q, k, v, the projections) once more.
    assert rel(got.to(f64), want.detach()) < 0.05
    got.float().sum().backward()
    assert all(w.grad is not None and w.grad.dtype == torch.bfloat16 for w in wb)


def test_bad_input_is_a_typed_error_naming_the_argument():
    x = torch.randn(1, 8, 16, dtype=f64)
    ws = random_weights("ttt_linear", 16)
    kw = CASES["ttt_linear"]
    before = ops.ttt_linear(x, ws, **kw).detach()
    with pytest.raises(membound.InvalidArgument) as e:
        ops.ttt_linear(x, ws[:-1], **kw)
    assert e.value.argument == "weights" and "14 tensors" in str(e.value) and "got 13" in str(e.value)
    with pytest.raises(membound.InvalidArgument) as e:
        ops.ttt_linear(x, [w.detach().float() if i == 3 else w for i, w in enumerate(ws)], **kw)
    assert e.value.argument == "weights[3] (ttt_norm_w)" and "float64" in str(e.value)
    with pytest.raises(membound.InvalidArgument) as e:
        ops.ttt_linear(x, [torch.zeros(5, dtype=f64) if i == 0 else w for i, w in enumerate(ws)], **kw)
    assert e.value.argument == "weights[0] (wq)" and "256 elements" in str(e.value)
    with pytest.raises(membound.InvalidArgument) as e:
        ops.ttt_linear(x, ws, heads=3)
    assert e.value.argument == "x" and "shape.width (x's axes)" in str(e.value)
    with pytest.raises(membound.InvalidArgument) as e:
        ops.attention(x.to(torch.int64), random_weights("attention", 16), heads=4)
    assert e.value.argument == "x"
    with pytest.raises(membound.InvalidArgument) as e:
        ops.attention(x, random_weights("attention", 16), heads=4, kv_heads=3, head_dim=8)
    assert e.value.argument == "kv_heads" and "'kv_heads'" in str(e.value)
    with pytest.raises(membound.InvalidArgument) as e:
        mnn.TTTLinear(30, 4)
    assert e.value.argument == "heads"
    with pytest.raises(membound.InvalidArgument) as e:
        mnn.TTTLinear(32, 4, mini_batch=12)
    assert e.value.argument == "mini_batch" and "(1, 2, 4, 8, 16, 32, 64)" in str(e.value)
    with pytest.raises(membound.InvalidArgument) as e:
        ops.ttt_linear(x, ws, **kw, mini_batch=12)
    assert e.value.argument == "mini_batch" and "got 12" in str(e.value)
    with pytest.raises(membound.InvalidArgument) as e:  # a token offset of 16 for mini-batches of 8
        ops.ttt_linear(x, ws, **kw, mini_batch=8)
    assert e.value.argument == "weights[9] (tok_offset)" and "8 elements" in str(e.value)
    # Nothing was changed by the refused calls: the same call gives the answer it gave before them.
    assert torch.equal(ops.ttt_linear(x, ws, **kw), before)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_thousand_calls_hold_no_memory():
    model = Hybrid(torch.float32)
    x = torch.randn(1, 16, 32)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    for _ in range(50):  # warm: the pools, PyTorch's caches
        step()
    gc.collect()
    before = _rss()
    for _ in range(1000):
        step()
    gc.collect()
    grown = _rss() - before
    # One step's tensors are ~0.2 MiB; a leak of one saved buffer per call would be > 20 MiB.
    assert grown < 8 << 20, f"resident memory grew {grown} bytes over 1,000 steps"


@pytest.mark.parametrize("make", [
    lambda: mnn.TTTLinear(32, 4, use_gate=True, dtype=f64),
    lambda: mnn.TTTMLP(32, 2, dtype=f64),
    lambda: mnn.TTTLinear(32, 4, mini_batch=4, dtype=f64),
    lambda: mnn.TTTMLP(32, 2, mini_batch=64, dtype=f64),
    lambda: mnn.Mamba(32, dtype=f64),
    lambda: mnn.Attention(32, 4, 2, 8, dtype=f64),
    lambda: mnn.Attention(32, 4, 2, 8, window=5, dtype=f64),
], ids=["ttt_linear", "ttt_mlp", "ttt_linear_b4", "ttt_mlp_b64", "mamba", "attention", "attention_window"])
def test_stepping_token_by_token_equals_forward(make):
    torch.manual_seed(9)
    m = make()
    with torch.no_grad():
        for p in m.parameters():  # away from the initialisation's zeros, so every weight matters
            p.add_(0.05 * torch.randn_like(p))
    B, T = 2, 37
    x = torch.randn(B, T, 32, dtype=f64)
    full = m(x).detach()
    state = m.decoding_state(B, T) if isinstance(m, mnn.Attention) else m.decoding_state(B)
    if isinstance(m, mnn.Attention) and m.window:
        assert state.nbytes == mnn.Attention(32, 4, 2, 8, window=5, dtype=f64).decoding_state(B, 10 * T).nbytes
    steps = torch.stack([m.step(x[:, t], state) for t in range(T)], dim=1)
    assert state.position == T
    assert rel(steps, full) < 1e-12


def test_decoding_refuses_bad_input_and_keeps_its_state():
    torch.manual_seed(10)
    m = mnn.Attention(32, 4, 2, 8, dtype=f64)
    x = torch.randn(2, 4, 32, dtype=f64)
    state = m.decoding_state(2, 3)
    ys = [m.step(x[:, t], state) for t in range(3)]
    with pytest.raises(membound.InvalidArgument) as e:
        m.step(x[:, 3], state)  # past max_len
    assert e.value.argument == "cache" and state.position == 3
    fresh = m.decoding_state(2, 3)
    for bad in (x[:, 0].t().contiguous(), x[:, 0].float(), x[:1, 0]):
        with pytest.raises(membound.InvalidArgument) as e:
            m.step(bad, fresh)
        assert e.value.argument == "x_t" and fresh.position == 0
    assert torch.equal(m.step(x[:, 0], fresh), ys[0])
    with pytest.raises(membound.InvalidArgument) as e:
        mnn.Attention(32, 4, causal=False, dtype=f64).decoding_state(2, 8)
    assert e.value.argument == "causal"
    with pytest.raises(membound.InvalidArgument) as e:
        membound.ops.decode_state("mamba", random_weights("mamba", 32)[:-1], batch=1, width=32, dtype=f64,
                                  **CASES["mamba"])
    assert e.value.argument == "weights"


def test_decoding_keeps_its_thread_count():
    m = mnn.Attention(32, 4, 2, 8, dtype=f64)
    x = torch.randn(1, 6, 32, dtype=f64)
    before = torch.get_num_threads()
    state = m.decoding_state(1, 6)
    try:
        torch.set_num_threads(before + 3)  # a bigger pool would need a bigger step workspace
        steps = torch.stack([m.step(x[:, t], state) for t in range(6)], dim=1)
    finally:
        torch.set_num_threads(before)
    assert rel(steps, m(x).detach()) < 1e-12


# ---- Packed variable-length sequences (cu_seqlens) ------------------------------------------------

PACKED_CASES = dict(CASES, attention_window=dict(heads=4, kv_heads=2, head_dim=8, window=5))


def _packed_op(name):
    kind = "attention" if name == "attention_window" else name
    return kind, getattr(ops, kind), PACKED_CASES[name]


def _offsets(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


@pytest.mark.parametrize("name", list(PACKED_CASES))
def test_packed_sequences_equal_each_sequence_alone(name):
    """A packed batch computes what each of its sequences computes alone (FlashAttention's varlen,
    Mamba's seq_idx, a per-sequence TTT run): lengths 1, b - 1, b, b + 1 (b = 16, TTT's mini-batch),
    an empty one, and a long one among short ones; y, dx and the weight gradients (summed over the
    sequences) within 1e-10 of the largest magnitude (float64, other orders of summation)."""
    kind, f, attrs = _packed_op(name)
    lengths = [1, 15, 16, 0, 17, 40, 3]
    T = sum(lengths)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1, T, 16, dtype=f64, generator=gen)
    dy = torch.randn(1, T, 16, dtype=f64, generator=gen)
    ws = random_weights(kind, 16)
    xp = x.clone().requires_grad_(True)
    yp = f(xp, ws, cu_seqlens=_offsets(lengths), **attrs)
    (yp * dy).sum().backward()
    packed_grads = [w.grad.clone() for w in ws]
    for w in ws:
        w.grad = None
    ys, dxs = [], []
    start = 0
    for n in lengths:
        if n == 0:
            continue
        xs = x[:, start:start + n].clone().requires_grad_(True)
        y = f(xs, ws, **attrs)
        (y * dy[:, start:start + n]).sum().backward()
        ys.append(y.detach())
        dxs.append(xs.grad)
        start += n
    assert rel(yp.detach(), torch.cat(ys, dim=1)) < TOL
    assert rel(xp.grad, torch.cat(dxs, dim=1)) < TOL
    for (pname, _), a, w in zip(ops.parameters(kind, 16, **attrs), packed_grads, ws):
        assert rel(a, w.grad) < TOL, pname


@pytest.mark.parametrize("name", list(PACKED_CASES))
def test_packed_gradcheck_in_float64(name):
    kind, f, attrs = _packed_op(name)
    x = torch.randn(1, 12, 16, dtype=f64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    cu = _offsets([5, 1, 6])
    ws = random_weights(kind, 16, scale=0.5)
    assert torch.autograd.gradcheck(lambda x, *w: f(x, list(w), cu_seqlens=cu, **attrs), (x, *ws), eps=1e-6,
                                    atol=1e-7)


@pytest.mark.parametrize("name", list(PACKED_CASES))
def test_packed_opcheck_and_saved_size(name):
    """The fake's saved size is the layer's for T tokens in S sequences (the layers size the worst
    case of any packing, so they need no offsets), so a traced graph holds the bytes eager
    allocates."""
    kind, _, attrs = _packed_op(name)
    fwd = ops._OPS[kind][0]
    x = torch.randn(1, 21, 16, dtype=f64, requires_grad=True)
    ws = random_weights(kind, 16)
    values = [attrs.get(n, v) for n, v in zip(ops._ATTRS[kind], _defaults(kind))]
    cu = _offsets([4, 16, 1])
    torch.library.opcheck(fwd, (x, ws, cu, *values), test_utils=("test_schema", "test_autograd_registration",
                                                                   "test_faketensor"))
    y, saved = fwd(x, ws, cu, *values)
    assert saved.numel() == ops.sizes(kind, x.shape, f64, sequences=3, **attrs)["saved"] + 256


def test_packed_under_torch_compile():
    torch.manual_seed(0)
    model = Hybrid(f64)
    cu = _offsets([7, 16, 1])
    x = torch.randn(1, 24, 32, dtype=f64)

    def run(m):
        h = x
        for layer in m.layers:
            h = h + layer(h, cu)
        return h

    eager = run(model)
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")(model)
    assert rel(compiled, eager) < TOL


def test_packed_bad_input_is_a_typed_error():
    kind, f, attrs = _packed_op("ttt_linear")
    ws = random_weights(kind, 16)
    x = torch.randn(1, 10, 16, dtype=f64)
    bad = {
        "decreasing": torch.tensor([0, 6, 4, 10], dtype=torch.int32),
        "not the total": torch.tensor([0, 4, 9], dtype=torch.int32),
        "not from 0": torch.tensor([1, 4, 10], dtype=torch.int32),
        "int64": torch.tensor([0, 4, 10]),
        "one entry": torch.tensor([0], dtype=torch.int32),
        "on another device": torch.tensor([0, 4, 10], dtype=torch.int32, device="meta"),
    }
    for why, cu in bad.items():
        with pytest.raises(membound.InvalidArgument) as e:
            f(x, ws, cu_seqlens=cu, **attrs)
        assert e.value.argument == "cu_seqlens", why
    with pytest.raises(membound.InvalidArgument) as e:
        f(torch.randn(2, 5, 16, dtype=f64), ws, cu_seqlens=_offsets([4, 6]), **attrs)
    assert e.value.argument == "x"
