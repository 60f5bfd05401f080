"""membound.ops on CUDA tensors (membound._layers_cuda) against the same ops on the CPU.

Runs where this install has the CUDA layers (built where nvcc is found) and torch finds a GPU;
everywhere else every test is skipped (CI's machine has nvcc but no GPU: there the module's two
halves are compiled, never linked or run; tools/gpu_session.sh's torch_ops step imports the module
before it runs these, so that a module that does not load is a failure there, not a skip).

The metric is the C++ CUDA tests' (tests/cuda/cuda_test_support.cuh): the largest absolute error
over max(1e-2, the largest magnitude of the CPU's values). float32: the CUDA op against the CPU op
in float64 on the same inputs, 1e-5, and 5e-5 for TTT's parameter gradients: some (its rates and
token offsets) are sums over every token with cancellation, where the float32 CPU op is itself
2.2e-5 from float64 and the device sums in other orders (tests/cuda/test_cuda_ttt.cu's
gradients64). bfloat16: the CUDA op in
bfloat16 against the CPU op in float32 on the same bf16-rounded inputs, 6.25e-2, their loosest
bf16 bound (Mamba against the fp32 CPU, TTT's gradients).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import membound.nn as mnn  # noqa: E402
import membound.ops as ops  # noqa: E402
from membound import InvalidArgument  # noqa: E402

pytestmark = pytest.mark.skipif(not (ops.CUDA_AVAILABLE and torch.cuda.is_available()),
                                reason="needs membound's CUDA layers and a GPU")

TOL = {torch.float32: 1e-5, torch.bfloat16: 6.25e-2}
TTT_GRAD_TOL_FP32 = 5e-5
# The CPU reference's dtype for each CUDA dtype.
REFERENCE = {torch.float32: torch.float64, torch.bfloat16: torch.float32}

# (kind, attributes, width): each layer at a shape whose TTT sequence crosses mini-batches.
CASES = [
    ("attention", {"heads": 4, "kv_heads": 2, "head_dim": 16}, 64),
    ("attention", {"heads": 4, "kv_heads": 4, "head_dim": 16, "window": 5}, 64),
    ("mamba", {"d_inner": 128, "d_state": 16, "d_conv": 4, "dt_rank": 4}, 64),
    ("ttt_linear", {"heads": 4, "mini_batch": 16}, 64),
    ("ttt_mlp", {"heads": 4, "mini_batch": 16, "use_gate": True}, 64),
]
# Each op's attributes in schema order (ops._ATTRS) with the public functions' defaults.
DEFAULTS = {
    "attention": (0, 0, 0, True, 0, 10000.0),
    "mamba": (0, 16, 4, 0),
    "ttt_linear": (0, False, 1.0, 10000.0, 16),
    "ttt_mlp": (0, False, 1.0, 10000.0, 16),
}
OPS = {"attention": ops.attention, "mamba": ops.mamba, "ttt_linear": ops.ttt_linear, "ttt_mlp": ops.ttt_mlp}


def grad_tol(kind: str, dtype: torch.dtype) -> float:
    """A parameter gradient's bound (the module docstring says why TTT's float32 one is looser)."""
    return TTT_GRAD_TOL_FP32 if dtype == torch.float32 and kind.startswith("ttt") else TOL[dtype]


def error(ours: torch.Tensor, want: torch.Tensor) -> float:
    """The largest absolute error over max(1e-2, the largest |want|), as the C++ CUDA tests."""
    d, w = ours.double().cpu(), want.double().cpu()
    return (d - w).abs().max().item() / max(1e-2, w.abs().max().item())


def weights_for(kind: str, attrs: dict, width: int, dtype: torch.dtype, device: str, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, shape in ops.parameters(kind, width, **attrs):
        w = 0.2 * torch.randn(*shape, generator=gen, dtype=torch.float64)
        if name in ("ttt_norm_w", "post_w"):
            w = w * 0.5 + 1.0
        if name == "a_log":
            w = torch.log(torch.arange(1, shape[1] + 1, dtype=torch.float64)).expand(shape).clone()
        out.append(w.to(dtype).to(device))
    return out


def run(kind: str, attrs: dict, x: torch.Tensor, weights: list, dy: torch.Tensor, cu_seqlens=None):
    x = x.clone().requires_grad_(True)
    ws = [w.clone().requires_grad_(True) for w in weights]
    y = OPS[kind](x, ws, cu_seqlens=cu_seqlens, **attrs)
    y.backward(dy)
    return y.detach(), x.grad, [w.grad for w in ws]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,attrs,width", CASES)
def test_cuda_equals_cpu(kind, attrs, width, dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 37, width, generator=gen, dtype=torch.float64).to(dtype)
    dy = torch.randn(2, 37, width, generator=gen, dtype=torch.float64).to(dtype)
    wc = weights_for(kind, attrs, width, dtype, "cpu")
    # The CPU reference on the same (for bfloat16: bf16-rounded) inputs.
    ref = REFERENCE[dtype]
    yc, dxc, gc = run(kind, attrs, x.to(ref), [w.to(ref) for w in wc], dy.to(ref))
    yg, dxg, gg = run(kind, attrs, x.cuda(), [w.cuda() for w in wc], dy.cuda())
    assert yg.is_cuda and dxg.is_cuda and all(g.is_cuda for g in gg)
    tol = TOL[dtype]
    assert error(yg, yc) <= tol
    assert error(dxg, dxc) <= tol
    for (name, _), a, b in zip(ops.parameters(kind, width, **attrs), gg, gc):
        assert error(a, b) <= grad_tol(kind, dtype), name


# Packed sequences of lengths 5, 0, 16, 17, 1 and 9: a partial mini-batch, an empty sequence, one of
# exactly a mini-batch and one of a mini-batch and a token, a single token.
CU_SEQLENS = [0, 5, 5, 21, 38, 39, 48]


@pytest.mark.parametrize("cu_on_gpu", [False, True])
@pytest.mark.parametrize("kind,attrs,width", CASES)
def test_packed_equals_cpu(kind, attrs, width, cu_on_gpu):
    """Packed sequences on CUDA tensors in float32 against the CPU op's packed call in float64
    (which test_ops.py holds equal to each sequence run alone): cu_seqlens on the CPU, or beside x
    (one copy)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, CU_SEQLENS[-1], width, generator=gen)
    dy = torch.randn(1, CU_SEQLENS[-1], width, generator=gen)
    cu = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    wc = [w.float() for w in weights_for(kind, attrs, width, torch.float32, "cpu")]
    yc, dxc, gc = run(kind, attrs, x.double(), [w.double() for w in wc], dy.double(), cu)
    yg, dxg, gg = run(kind, attrs, x.cuda(), [w.cuda() for w in wc], dy.cuda(), cu.cuda() if cu_on_gpu else cu)
    tol = TOL[torch.float32]
    assert error(yg, yc) <= tol
    assert error(dxg, dxc) <= tol
    for (name, _), a, b in zip(ops.parameters(kind, width, **attrs), gg, gc):
        assert error(a, b) <= grad_tol(kind, torch.float32), name


@pytest.mark.parametrize("kind,attrs,width", CASES)
def test_every_byte_from_pytorch(kind, attrs, width):
    """Every byte a call takes comes from PyTorch's allocator: after a warm-up step (cuBLASLt's
    plans, the kernels' modules loaded lazily), the device's free bytes move only with PyTorch's
    reserve."""
    x = torch.randn(2, 37, width, device="cuda", requires_grad=True)
    ws = weights_for(kind, attrs, width, torch.float32, "cuda")

    def step():
        OPS[kind](x, ws, **attrs).sum().backward()
        torch.cuda.synchronize()

    step()
    free0, reserved0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    step()
    free1, reserved1 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    assert free0 - free1 == reserved1 - reserved0


@pytest.mark.parametrize("kind,attrs,width", CASES)
def test_fake_tensors_on_cuda(kind, attrs, width):
    """The fake implementation on CUDA: the CUDA layers' saved size, schema and autograd checks."""
    x = torch.randn(2, 9, width, device="cuda", requires_grad=True)
    ws = [w.requires_grad_(True) for w in weights_for(kind, attrs, width, torch.float32, "cuda")]
    values = tuple(ops._with_defaults(kind, width, attrs).get(a, d) for a, d in zip(ops._ATTRS[kind], DEFAULTS[kind]))
    torch.library.opcheck(ops._OPS[kind][0], (x, ws, None, *values),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("kind,attrs,width", CASES)
def test_saved_bytes_through_save_on_cpu(kind, attrs, width):
    """save_on_cpu moves the saved bytes to the host and back between forward and backward."""
    x = torch.randn(2, 37, width, device="cuda")
    ws = weights_for(kind, attrs, width, torch.float32, "cuda")
    dy = torch.randn_like(x)
    want = run(kind, attrs, x, ws, dy)
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        got = run(kind, attrs, x, ws, dy)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))


@pytest.mark.parametrize("kind,attrs,width", CASES)
def test_decode_equals_forward_rows(kind, attrs, width):
    x = torch.randn(2, 21, width, device="cuda")
    ws = weights_for(kind, attrs, width, torch.float32, "cuda")
    with torch.no_grad():
        y = OPS[kind](x, ws, **attrs)
    state = ops.decode_state(kind, ws, batch=2, width=width, max_len=21, **attrs)
    assert state.data.is_cuda
    rows = torch.stack([ops.decode_step(x[:, t], ws, state) for t in range(21)], dim=1)
    assert error(rows, y) <= 1e-5


def test_side_stream_orders_like_pytorch():
    """On a side stream the op runs on that stream: the same result, no synchronization needed."""
    kind, attrs, width = CASES[3]
    x = torch.randn(2, 37, width, device="cuda")
    ws = weights_for(kind, attrs, width, torch.float32, "cuda")
    want = OPS[kind](x, ws, **attrs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = OPS[kind](x * 1.0, ws, **attrs)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, want)  # the kernels are deterministic: bit for bit


def test_compile_on_cuda():
    torch.manual_seed(0)
    model = torch.nn.Sequential(mnn.TTTLinear(64, 4), mnn.Attention(64, 4)).cuda()
    x = torch.randn(2, 40, 64, device="cuda")
    want = model(x)
    got = torch.compile(model, fullgraph=True)(x)
    assert error(got, want) <= 1e-6


def test_bad_input_on_cuda():
    kind, attrs, width = CASES[0]
    x = torch.randn(1, 8, width, device="cuda")
    ws = weights_for(kind, attrs, width, torch.float32, "cuda")
    with pytest.raises(InvalidArgument) as e:
        OPS[kind](x, [ws[0].cpu()] + ws[1:], **attrs)
    assert e.value.argument == "weights[0]"
    with pytest.raises(InvalidArgument) as e:
        OPS[kind](x.double(), [w.double() for w in ws], **attrs)
    assert e.value.argument == "x"
