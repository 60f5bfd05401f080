"""membound's layers over caller-owned host arrays (nanobind). Use membound.ops and membound.nn."""

from typing import Any

ttt_mini_batches: list[int]

class Spec:
    """One layer call: the layer, its dtype, the input's shape and the layer's attributes."""

    kind: str
    dtype: str
    batch: int
    seq: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    window: int
    causal: bool
    rope_base: float
    d_inner: int
    d_state: int
    d_conv: int
    dt_rank: int
    use_gate: bool
    base_lr: float
    mini_batch: int
    sequences: int
    threads: int
    device: int
    stream: int
    def __init__(self) -> None: ...

def parameters(spec: Spec) -> list[tuple[str, list[int]]]: ...
def sizes(spec: Spec) -> tuple[int, int, int]: ...
def forward(spec: Spec, x: Any, weights: list[Any], y: Any, saved: Any, workspace: Any,
            offsets: Any | None = None) -> None: ...
def backward(spec: Spec, x: Any, weights: list[Any], saved: Any, dy: Any, dx: Any, grads: list[Any],
             workspace: Any, offsets: Any | None = None) -> None: ...
def decode_sizes(spec: Spec, max_len: int) -> tuple[int, int]: ...
def decode_reset(spec: Spec, weights: list[Any], state: Any, max_len: int) -> None: ...
def decode_step(spec: Spec, weights: list[Any], state: Any, position: int, max_len: int, x_t: Any, y_t: Any,
                workspace: Any) -> None: ...
