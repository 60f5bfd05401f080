"""membound's layers as PyTorch custom ops (torch.library), forward and hand-written backward.

    import membound.ops  # registers torch.ops.membound.{attention,mamba,ttt_linear,ttt_mlp}_{forward,backward}
    y = membound.ops.ttt_linear(x, weights, heads=4)  # differentiable; torch.compile traces it

Each op takes the input x [B, T, C] and the layer's parameters as a list in membound's order and
layout (`parameters(kind, ...)` names them; matrices are [in, out], y = x·W) and returns y. Under
autograd the forward op also returns the bytes it keeps for backward (a uint8 tensor of the layer's
saved_bytes plus 256: the layers carve from a 256-byte boundary, PyTorch's host allocator aligns to
64, and byte 0 says where the layer's bytes start) and the backward op recomputes what it did not keep, as the C++ layers do.
Every buffer -- y, the saved bytes, the workspace -- is a tensor PyTorch allocates, sized by the
layer's own size functions (`sizes`), so a budgeted allocator sees all of it; non-contiguous inputs
(nn.Linear weights passed transposed) are also copied to contiguous ones for the call. The fake (meta)
implementations give torch.compile the same shapes and saved sizes without running anything (under
dynamic shapes the saved size is an unbacked symbolic size: the layers' size functions are C++).

Semantics are the C++ layers' (docs/concepts.md): attention with RoPE and GQA (window for
sliding-window attention), the Mamba-1 block (mamba_simple without the fused kernels), TTT-Linear and
TTT-MLP as test-time-training/ttt-lm-pytorch's TTTLinear/TTTMLP without share_qk/pre_conv. The
modules with upstream parameter names are in membound.nn.

Decoding, one token per sequence: decode_state() and decode_step() (membound.nn's step()), the
state in a byte tensor PyTorch allocates, stepped outside autograd.

Devices: CPU tensors (float32, float64, bfloat16) run the host layers; CUDA tensors (float32,
bfloat16) run membound's CUDA kernels (_layers_cuda, built where nvcc is found) on PyTorch's current
stream, without waiting for the device, like PyTorch's own kernels. CUDA_AVAILABLE says whether this
install has them. The CUDA path has been compiled but not yet run on a GPU (docs/python.md).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Optional, Sequence

import torch

from . import _layers
from ._errors import InvalidArgument, invalid

# The CUDA layers, where the package was built with nvcc. _CUDA_IMPORT_ERROR: why a module that was
# built did not load (a library missing), said when a CUDA tensor arrives; None when it loaded or
# was never built.
_CUDA_IMPORT_ERROR: Optional[ImportError] = None
try:
    from . import _layers_cuda
except ImportError as _e:
    _layers_cuda = None
    if importlib.util.find_spec(f"{__package__}._layers_cuda") is not None:
        _CUDA_IMPORT_ERROR = _e

__all__ = ["attention", "mamba", "ttt_linear", "ttt_mlp", "parameters", "sizes", "DecodeState", "decode_state",
           "decode_step", "TTT_MINI_BATCHES", "CUDA_AVAILABLE"]

# The TTT mini-batch sizes built into the extension (a compile-time policy of the C++ layer).
TTT_MINI_BATCHES: tuple[int, ...] = tuple(_layers.ttt_mini_batches)
# Whether this install has the CUDA layers (torch.cuda may still find no GPU).
CUDA_AVAILABLE: bool = _layers_cuda is not None

_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16"}


def _backend(device: Optional[torch.device]) -> Any:
    """The extension module that runs a call on `device`: _layers for the host (and the meta device),
    _layers_cuda for CUDA tensors."""
    if device is None or device.type in ("cpu", "meta"):
        return _layers
    if device.type != "cuda":
        raise invalid("x", "a CPU or CUDA tensor", str(device), "Move the call's tensors to the CPU or a CUDA device")
    if _layers_cuda is None:
        why = ("it was built without nvcc" if _CUDA_IMPORT_ERROR is None
               else f"its CUDA layers did not load: {_CUDA_IMPORT_ERROR}")
        raise invalid("x", f"a CPU tensor (this membound has no CUDA layers: {why})", str(device),
                      "Run the op on CPU tensors, or install membound where nvcc and the CUDA libraries are found")
    return _layers_cuda


def _spec(kind: str, x_shape: Sequence[int], dtype: torch.dtype, attrs: dict[str, Any],
          device: Optional[torch.device] = None, sequences: int = 0) -> Any:
    on_cuda = device is not None and device.type == "cuda"
    s = _backend(device).Spec()
    s.sequences = sequences
    s.kind = kind
    if dtype not in _DTYPES:
        raise invalid("x", "a float32, float64 or bfloat16 tensor", str(dtype), "Cast the input and the parameters")
    s.dtype = _DTYPES[dtype]
    if len(x_shape) != 3:
        raise invalid("x", "a tensor [batch, seq, width]", tuple(x_shape), "Reshape the input to three axes")
    s.batch, s.seq, s.width = (int(d) for d in x_shape)
    for name, value in attrs.items():
        setattr(s, name, value)
    s.threads = torch.get_num_threads()
    if on_cuda and dtype == torch.float64:
        raise invalid("x", "a float32 or bfloat16 tensor on CUDA", str(dtype),
                      "Cast to float32 (float64 runs on CPU tensors only)")
    return s


def _call_spec(kind: str, x_shape: Sequence[int], dtype: torch.dtype, attrs: dict[str, Any],
               device: torch.device, sequences: int = 0) -> Any:
    """_spec for a call that runs: on CUDA with its device and PyTorch's current stream there (0:
    the legacy default stream)."""
    s = _spec(kind, x_shape, dtype, attrs, device, sequences)
    if device.type == "cuda":
        s.device = device.index if device.index is not None else torch.cuda.current_device()
        s.stream = torch.cuda.current_stream(s.device).cuda_stream
    return s


_X_FIELDS = ("shape.batch", "shape.seq", "shape.width", "shape.d_model")


# The packed sequences' fields in the C++ layers and the extension: this module's cu_seqlens.
_PACKED_FIELDS = ("shape.offsets", "shape.sequences", "offsets")


def _layer_call(fn, *args, **kwargs):
    """Calls _layers.fn; the C++ layers name shape fields (shape.kv_heads), which are this module's
    arguments (kv_heads), the input's axes (x) or the packed sequences' offsets (cu_seqlens)."""
    try:
        return fn(*args, **kwargs)
    except InvalidArgument as e:
        if e.argument in _PACKED_FIELDS:
            name = "cu_seqlens"
        elif e.argument.startswith("shape."):
            name = "x" if e.argument in _X_FIELDS else e.argument[len("shape."):]
        else:
            raise
        shown = f"{e.argument} (x's axes)" if name == "x" else name
        raise InvalidArgument(str(e).replace(f"'{e.argument}'", f"'{shown}'", 1), name, e.expected, e.got,
                              e.todo) from None


def _with_defaults(kind: str, width: int, attrs: dict[str, Any]) -> dict[str, Any]:
    """The attributes with the ops' defaults filled in (as attention(), mamba() take them)."""
    a = {k: v for k, v in attrs.items() if v is not None}  # None: the default, as attention() takes it
    if kind == "attention" and a.get("heads"):
        a.setdefault("kv_heads", a["heads"])
        a.setdefault("head_dim", width // a["heads"])
    if kind == "mamba":
        a.setdefault("d_inner", 2 * width)
        a.setdefault("dt_rank", -(-width // 16))
    return a


def parameters(kind: str, width: int, **attrs: Any) -> list[tuple[str, list[int]]]:
    """(name, shape) of each parameter an op takes, in its order and membound's layout."""
    spec = _spec(kind, (1, 1, width), torch.float32, _with_defaults(kind, width, attrs))
    return [(n, list(d)) for n, d in _layer_call(_layers.parameters, spec)]


def sizes(kind: str, x_shape: Sequence[int], dtype: torch.dtype = torch.float32, device: Any = "cpu",
          sequences: int = 0, **attrs: Any) -> dict[str, int]:
    """Bytes one call needs besides its inputs and y, from the layer's size functions on `device`'s
    backend: saved for backward, and the workspaces. The op's saved tensor is saved + 256 bytes
    (_saved_layout). sequences: packed sequences on x's token axis (x [1, T, C]); the bytes are the
    worst case of any packing of T tokens into that many, so one size serves every batch of them."""
    dev = torch.device(device)
    s = _spec(kind, x_shape, dtype, _with_defaults(kind, x_shape[-1], attrs), dev, sequences)
    saved, fws, bws = _layer_call(_backend(dev).sizes, s)
    return {"saved": saved, "forward_workspace": fws, "backward_workspace": bws}


def _placed(device: torch.device, tensors: Sequence[tuple[str, torch.Tensor]]) -> Any:
    """The backend module for `device`, once every tensor is on it (one call runs on one device)."""
    if device.type not in ("cpu", "cuda"):
        raise invalid(tensors[0][0] if tensors else "x", "a CPU or CUDA tensor", str(device),
                      "Move the call's tensors to the CPU or a CUDA device")
    for name, t in tensors:
        if t.device != device:
            raise invalid(name, f"a tensor on {device} (the call's device)", str(t.device),
                          "Move every tensor of one call to one device")
    return _backend(device)


def _named_tensors(x: Optional[torch.Tensor], weights: Sequence[torch.Tensor],
                   x_name: str = "x") -> list[tuple[str, torch.Tensor]]:
    return ([(x_name, x)] if x is not None else []) + [(f"weights[{i}]", w) for i, w in enumerate(weights)]


# The layers carve their bytes from a 256-byte boundary; PyTorch's host allocator aligns to 64.
_ALIGN = 256


def _aligned(n: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """n bytes starting at a 256-byte boundary: a view into a buffer 255 bytes longer."""
    buf = torch.empty(n + _ALIGN - 1, dtype=torch.uint8, device=device)
    start = -buf.data_ptr() % _ALIGN
    return buf[start:start + n]


def _is_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % _ALIGN == 0


# The saved tensor (a forward output, so a fresh tensor at offset 0): byte 0 holds k - 1, where the
# layer's bytes start at byte k in 1..256, a 256-byte boundary when forward wrote them. Hooks that
# copy saved tensors (saved_tensors_hooks, save_on_cpu) move it to another address: backward then
# finds the bytes by the header and copies them to a boundary again. On CUDA the bytes always start
# at byte 256 (k = 256, what a 256-byte-aligned buffer gives, as PyTorch's CUDA allocator's are),
# so that backward never reads the header back from the device (a synchronization).
def _saved_layout(n: int, device: Optional[torch.device] = None) -> torch.Tensor:
    return torch.empty(n + _ALIGN, dtype=torch.uint8, device=device)


def _saved_payload_for_forward(saved: torch.Tensor) -> torch.Tensor:
    k = _ALIGN if saved.is_cuda else -(saved.data_ptr() + 1) % _ALIGN + 1
    saved[0] = k - 1
    return saved[k:k + saved.numel() - _ALIGN]


def _saved_payload_for_backward(saved: torch.Tensor) -> torch.Tensor:
    k = _ALIGN if saved.is_cuda else int(saved[0]) + 1
    payload = saved[k:k + saved.numel() - _ALIGN]
    if payload.is_contiguous() and _is_aligned(payload):
        return payload
    moved = _aligned(payload.numel(), saved.device)
    moved.copy_(payload)
    return moved


def _check_cu_seqlens(cu_seqlens: torch.Tensor, device: torch.device) -> None:
    """What a trace can check of cu_seqlens without its values or (symbolic) length."""
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise invalid("cu_seqlens", "a 1-D int32 tensor of S + 1 offsets (S >= 1): 0, the starts, the total",
                      f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}", "Pass torch.tensor([0, len0, len0 + len1, ...], "
                      "dtype=torch.int32)")
    if cu_seqlens.device.type != "cpu" and cu_seqlens.device != device:
        raise invalid("cu_seqlens", f"on the CPU or on x's device ({device})", str(cu_seqlens.device),
                      "Keep cu_seqlens on the CPU (no copy) or beside x")


def _packed(cu_seqlens: Optional[torch.Tensor], device: torch.device) -> tuple[int, Optional[torch.Tensor]]:
    """(sequences, offsets) of the packed sequences, or (0, None): cu_seqlens as FlashAttention's
    varlen functions take it, S + 1 int32 offsets, 0 first and the total last. The layers read
    them on the host (their checks and sizes need the values; the CUDA layers copy them into their
    workspace), so cu_seqlens on a GPU costs one synchronizing copy per call: keep it on the CPU."""
    if cu_seqlens is None:
        return 0, None
    _check_cu_seqlens(cu_seqlens, device)
    if cu_seqlens.numel() < 2:
        raise invalid("cu_seqlens", "a 1-D int32 tensor of S + 1 offsets (S >= 1): 0, the starts, the total",
                      f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}", "Pass torch.tensor([0, len0, len0 + len1, ...], "
                      "dtype=torch.int32)")
    return cu_seqlens.numel() - 1, cu_seqlens.to("cpu").contiguous()


def _forward(kind: str, x: torch.Tensor, weights: list[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
             attrs: dict[str, Any]):
    layers = _placed(x.device, _named_tensors(x, weights))
    sequences, offsets = _packed(cu_seqlens, x.device)
    s = _call_spec(kind, x.shape, x.dtype, attrs, x.device, sequences)
    saved_bytes, fws, _ = _layer_call(layers.sizes, s)
    # The layers read contiguous arrays: a transposed nn.Linear weight is copied here (not counted
    # by sizes(); PyTorch frees the copy when the call returns).
    x = x.contiguous()
    ws = [w.contiguous() for w in weights]
    y = torch.empty_like(x)
    saved = _saved_layout(saved_bytes, x.device)
    payload = _saved_payload_for_forward(saved)
    # A CUDA allocator that does not align to 256 bytes: the layer writes an aligned copy.
    target = payload if _is_aligned(payload) else _aligned(saved_bytes, x.device)
    _layer_call(layers.forward, s, x, ws, y, target, _aligned(fws, x.device), offsets=offsets)
    if target is not payload:
        payload.copy_(target)
    return y, saved


def _backward(kind: str, x: torch.Tensor, weights: list[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
              saved: torch.Tensor, dy: torch.Tensor, attrs: dict[str, Any]):
    layers = _placed(x.device, _named_tensors(x, weights) + [("saved", saved), ("dy", dy)])
    sequences, offsets = _packed(cu_seqlens, x.device)
    s = _call_spec(kind, x.shape, x.dtype, attrs, x.device, sequences)
    _, _, bws = _layer_call(layers.sizes, s)
    x, dy = x.contiguous(), dy.contiguous().to(x.dtype)
    ws = [w.contiguous() for w in weights]
    dx = torch.empty_like(x)
    grads = [torch.zeros_like(w) for w in ws]  # the layers add (+=) their gradients
    _layer_call(layers.backward, s, x, ws, _saved_payload_for_backward(saved), dy, dx, grads,
                _aligned(bws, x.device), offsets=offsets)
    return dx, grads


def _example_value(d: Any) -> Optional[int]:
    """A size, or the example value a traced symbolic size stands for (None when it has none)."""
    if isinstance(d, int):
        return d
    try:
        hint = d.node.hint
    except AttributeError:
        return None
    return None if hint is None else int(hint)


def _fake_forward(kind: str, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor], attrs: dict[str, Any]):
    # The saved size is the layer's own, so a traced graph holds the bytes the eager op would. Under
    # dynamic shapes (a symbolic batch or length) it is an unbacked size instead: the C++ size
    # functions are not symbolic, and int() on a symbolic length would specialise the graph to it,
    # tracing again for every shape. The eager call still allocates the layer's exact bytes.
    symbolic = any(isinstance(d, torch.SymInt) for d in x.shape)
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, x.device)  # its dtype, rank and device, as eager checks them
        symbolic = symbolic or isinstance(cu_seqlens.shape[0], torch.SymInt)
        if not symbolic:
            _packed(cu_seqlens, x.device)  # and its length
    sequences = 0 if cu_seqlens is None or symbolic else cu_seqlens.shape[0] - 1
    if symbolic:
        # The arguments are checked as eager would (dtype, rank, width, attributes, mini_batch) on
        # a concrete stand-in shape, so a bad call fails while tracing, not inside the graph.
        if len(x.shape) != 3:
            raise invalid("x", "a tensor [batch, seq, width]", tuple(x.shape), "Reshape the input to three axes")
        width = _example_value(x.shape[-1])
        if width is not None:
            _layer_call(_backend(x.device).sizes, _spec(kind, [1, 1, width], x.dtype, attrs, x.device))
        saved_bytes = torch.library.get_ctx().new_dynamic_size(min=_ALIGN)
        return x.new_empty(x.shape), x.new_empty(saved_bytes, dtype=torch.uint8)
    saved_bytes = _layer_call(_backend(x.device).sizes,
                              _spec(kind, list(x.shape), x.dtype, attrs, x.device, sequences))[0]
    return x.new_empty(x.shape), x.new_empty(saved_bytes + _ALIGN, dtype=torch.uint8)


def _fake_backward(x: torch.Tensor, weights: list[torch.Tensor]):
    # Contiguous, as the real outputs are, whatever the inputs' strides.
    return x.new_empty(x.shape), [w.new_empty(w.shape) for w in weights]


# ---- The ops: one forward and one backward per layer, with explicit attributes --------------------

# Each layer's attributes after x and weights, in schema order (the functions below name them so).
_ATTRS = {
    "attention": ("heads", "kv_heads", "head_dim", "causal", "window", "rope_base"),
    "mamba": ("d_inner", "d_state", "d_conv", "dt_rank"),
    "ttt_linear": ("heads", "use_gate", "base_lr", "rope_base", "mini_batch"),
    "ttt_mlp": ("heads", "use_gate", "base_lr", "rope_base", "mini_batch"),
}


def _named(kind: str, values: Sequence[Any]) -> dict[str, Any]:
    return dict(zip(_ATTRS[kind], values))


@torch.library.custom_op("membound::attention_forward", mutates_args=())
def _attention_forward(x: torch.Tensor, weights: list[torch.Tensor], cu_seqlens: Optional[torch.Tensor], heads: int,
                       kv_heads: int, head_dim: int, causal: bool, window: int,
                       rope_base: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward("attention", x, weights, cu_seqlens, _named("attention", (heads, kv_heads, head_dim, causal, window,
                                                                              rope_base)))


@torch.library.custom_op("membound::attention_backward", mutates_args=())
def _attention_backward(x: torch.Tensor, weights: list[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                        saved: torch.Tensor, dy: torch.Tensor, heads: int, kv_heads: int, head_dim: int, causal: bool,
                        window: int, rope_base: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return _backward("attention", x, weights, cu_seqlens, saved, dy,
                     _named("attention", (heads, kv_heads, head_dim, causal, window, rope_base)))


@torch.library.custom_op("membound::mamba_forward", mutates_args=())
def _mamba_forward(x: torch.Tensor, weights: list[torch.Tensor], cu_seqlens: Optional[torch.Tensor], d_inner: int,
                   d_state: int, d_conv: int, dt_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward("mamba", x, weights, cu_seqlens, _named("mamba", (d_inner, d_state, d_conv, dt_rank)))


@torch.library.custom_op("membound::mamba_backward", mutates_args=())
def _mamba_backward(x: torch.Tensor, weights: list[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                    saved: torch.Tensor, dy: torch.Tensor, d_inner: int, d_state: int, d_conv: int,
                    dt_rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return _backward("mamba", x, weights, cu_seqlens, saved, dy, _named("mamba", (d_inner, d_state, d_conv, dt_rank)))


def _ttt_ops(kind: str):
    """TTT-Linear's or TTT-MLP's two ops: the same schema under two names."""

    @torch.library.custom_op(f"membound::{kind}_forward", mutates_args=())
    def forward(x: torch.Tensor, weights: list[torch.Tensor], cu_seqlens: Optional[torch.Tensor], heads: int,
                use_gate: bool, base_lr: float, rope_base: float, mini_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _forward(kind, x, weights, cu_seqlens, _named(kind, (heads, use_gate, base_lr, rope_base, mini_batch)))

    @torch.library.custom_op(f"membound::{kind}_backward", mutates_args=())
    def backward(x: torch.Tensor, weights: list[torch.Tensor], cu_seqlens: Optional[torch.Tensor], saved: torch.Tensor,
                 dy: torch.Tensor, heads: int, use_gate: bool, base_lr: float, rope_base: float,
                 mini_batch: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return _backward(kind, x, weights, cu_seqlens, saved, dy,
                         _named(kind, (heads, use_gate, base_lr, rope_base, mini_batch)))

    return forward, backward


_ttt_linear_forward, _ttt_linear_backward = _ttt_ops("ttt_linear")
_ttt_mlp_forward, _ttt_mlp_backward = _ttt_ops("ttt_mlp")


# ---- Fake implementations and autograd, the same for the four layers ---------------------------------

# kind -> (forward op, backward op)
_OPS = {
    "attention": (_attention_forward, _attention_backward),
    "mamba": (_mamba_forward, _mamba_backward),
    "ttt_linear": (_ttt_linear_forward, _ttt_linear_backward),
    "ttt_mlp": (_ttt_mlp_forward, _ttt_mlp_backward),
}


def _register(kind: str) -> None:
    fwd, bwd = _OPS[kind]

    def fake_forward(x, weights, cu_seqlens, *attrs):
        return _fake_forward(kind, x, cu_seqlens, _named(kind, attrs))

    def fake_backward(x, weights, cu_seqlens, saved, dy, *attrs):
        return _fake_backward(x, weights)

    def setup_context(ctx, inputs, output):
        x, weights, cu_seqlens, *attrs = inputs
        ctx.save_for_backward(x, output[1], cu_seqlens, *weights)
        ctx.attrs = attrs

    def backward(ctx, dy, _dsaved):
        x, saved, cu_seqlens, *weights = ctx.saved_tensors
        dx, grads = bwd(x, list(weights), cu_seqlens, saved, dy, *ctx.attrs)
        return (dx, list(grads), None) + (None,) * len(ctx.attrs)

    fwd.register_fake(fake_forward)
    bwd.register_fake(fake_backward)
    fwd.register_autograd(backward, setup_context=setup_context)


for _kind in _OPS:
    _register(_kind)


# ---- What users call ------------------------------------------------------------------------------

# cu_seqlens (every op): packed variable-length sequences, FlashAttention's varlen convention. x is
# [1, T, C] with the sequences end to end and cu_seqlens their S + 1 int32 offsets (0, the starts,
# T); each sequence is computed as if alone: attention only inside it, Mamba's convolution and scan
# from zero state at its start, TTT's inner state and mini-batches restarting with it, RoPE and
# TTT's token positions from 0. On CPU and CUDA tensors alike (cu_seqlens best on the CPU: _packed).

def attention(x: torch.Tensor, weights: Sequence[torch.Tensor], *, heads: int, kv_heads: int | None = None,
              head_dim: int | None = None, causal: bool = True, window: int = 0, rope_base: float = 10000.0,
              cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Multi-head attention with RoPE and GQA: weights [wq, wk, wv, wo] ([in, out] each)."""
    kv = heads if kv_heads is None else kv_heads
    hd = x.shape[-1] // heads if head_dim is None else head_dim
    return _attention_forward(x, list(weights), cu_seqlens, heads, kv, hd, causal, window, float(rope_base))[0]


def mamba(x: torch.Tensor, weights: Sequence[torch.Tensor], *, d_inner: int, d_state: int = 16, d_conv: int = 4,
          dt_rank: int | None = None, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Mamba-1 block: weights as parameters("mamba", ...) lists them."""
    r = -(-x.shape[-1] // 16) if dt_rank is None else dt_rank
    return _mamba_forward(x, list(weights), cu_seqlens, d_inner, d_state, d_conv, r)[0]


def ttt_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], *, heads: int, use_gate: bool = False,
               base_lr: float = 1.0, rope_base: float = 10000.0, mini_batch: int = 16,
               cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TTT-Linear with inner-loop mini-batches of mini_batch tokens (one of TTT_MINI_BATCHES; 16 is
    ttt-lm-pytorch's default): weights as parameters("ttt_linear", ...) lists them."""
    return _ttt_linear_forward(x, list(weights), cu_seqlens, heads, use_gate, float(base_lr), float(rope_base),
                               mini_batch)[0]


def ttt_mlp(x: torch.Tensor, weights: Sequence[torch.Tensor], *, heads: int, use_gate: bool = False,
            base_lr: float = 1.0, rope_base: float = 10000.0, mini_batch: int = 16,
            cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TTT-MLP with inner-loop mini-batches of mini_batch tokens (one of TTT_MINI_BATCHES; 16 is
    ttt-lm-pytorch's default): weights as parameters("ttt_mlp", ...) lists them."""
    return _ttt_mlp_forward(x, list(weights), cu_seqlens, heads, use_gate, float(base_lr), float(rope_base),
                            mini_batch)[0]


# ---- Decoding: one token per sequence ------------------------------------------------------------

class DecodeState:
    """A layer's single-token decoding state in a byte tensor PyTorch allocated: attention's KV cache
    (max_len positions; a ring of the window's last W under a window), Mamba's convolution and scan
    state, TTT's inner model and running sums. `position` counts the tokens decoded since
    decode_state(). TTT's inner model starts from W1, b1 (W2, b2) as they were then, and the cache
    keeps K, V of the weights that made them: after changing the parameters, make a new state."""

    def __init__(self, kind: str, batch: int, width: int, dtype: torch.dtype, attrs: dict[str, Any],
                 max_len: int, device: torch.device) -> None:
        self.kind, self.batch, self.width, self.dtype = kind, batch, width, dtype
        self.attrs, self.max_len, self.position = _with_defaults(kind, width, attrs), max_len, 0
        self.device, self._layers = device, _backend(device)
        # The pool's size is fixed with the state: the step workspace is sized for it.
        self.threads = torch.get_num_threads()
        state_bytes, step_workspace = _layer_call(self._layers.decode_sizes, self._spec(), max_len)
        self.data, self.workspace_bytes = _aligned(state_bytes, device), step_workspace
        self._weights_key: Optional[tuple] = None
        self._weights: list[torch.Tensor] = []

    def _spec(self) -> Any:
        s = _call_spec(self.kind, (self.batch, 1, self.width), self.dtype, self.attrs, self.device)
        s.threads = self.threads
        return s

    def _contiguous(self, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The weights as the layer reads them, copied once while they do not change (the nn
        modules pass nn.Linear weights transposed; a copy per token would triple a step's reads)."""
        key = tuple((w.data_ptr(), w._version, tuple(w.shape), w.stride(), w.dtype) for w in weights)
        if key != self._weights_key:
            self._weights = [w.detach().contiguous() for w in weights]
            self._weights_key = key
        return self._weights

    @property
    def nbytes(self) -> int:
        """The state's bytes, fixed when it is made (for attention without a window, ∝ max_len)."""
        return self.data.numel()


def decode_state(kind: str, weights: Sequence[torch.Tensor], *, batch: int, width: int,
                 dtype: torch.dtype = torch.float32, max_len: int = 0, **attrs: Any) -> DecodeState:
    """A started decoding state (TTT's from its weights) on the weights' device: see DecodeState.
    Attention decodes causally, at most max_len tokens (a window keeps only its last W of them)."""
    if kind == "attention" and max_len <= 0:
        raise invalid("max_len", "the positions the KV cache holds, at least 1", max_len, "e.g. max_len=4096")
    if kind == "attention" and not attrs.get("causal", True):
        raise invalid("causal", "True (decoding generates one token after another)", False,
                      "Decode with a causal attention layer")
    device = weights[0].device if len(weights) > 0 else torch.device("cpu")
    _placed(device, _named_tensors(None, weights))
    st = DecodeState(kind, batch, width, dtype, attrs, max_len, device)
    with torch.no_grad():
        _layer_call(st._layers.decode_reset, st._spec(), st._contiguous(weights), st.data, max_len)
    return st


def decode_step(x_t: torch.Tensor, weights: Sequence[torch.Tensor], state: DecodeState) -> torch.Tensor:
    """y_t = layer(x_t) for x_t [batch, width] at state.position; the state advances by one token
    (not when the call is refused). No autograd (decoding is inference); equals forward's row."""
    if tuple(x_t.shape) != (state.batch, state.width) or x_t.dtype != state.dtype:
        raise invalid("x_t", f"a {state.dtype} tensor [{state.batch}, {state.width}] (one token per sequence)",
                      f"{x_t.dtype} {tuple(x_t.shape)}", "Pass x[:, t] of the state's batch, width and dtype")
    with torch.no_grad():
        _placed(state.device, _named_tensors(x_t, weights, "x_t"))
        x_t = x_t.detach().contiguous()
        y_t = torch.empty_like(x_t)
        _layer_call(state._layers.decode_step, state._spec(), state._contiguous(weights), state.data, state.position,
                    state.max_len, x_t, y_t, _aligned(state.workspace_bytes, state.device))
    state.position += 1
    return y_t
