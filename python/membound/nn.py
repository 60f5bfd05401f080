"""membound's layers as torch.nn modules whose parameters carry the upstream names and shapes, so
a checkpoint of the upstream module loads (load_state_dict) and a membound one loads upstream:

- TTTLinear / TTTMLP: test-time-training/ttt-lm-pytorch's TTTLinear / TTTMLP (q_proj, k_proj,
  v_proj, o_proj, g_proj, learnable_ttt_lr_weight, learnable_ttt_lr_bias, learnable_token_idx,
  ttt_norm_weight, ttt_norm_bias, post_norm, W1, b1, W2, b2), without share_qk / pre_conv.
- Mamba: state-spaces/mamba's Mamba (mamba_simple: in_proj, conv1d, x_proj, dt_proj, A_log, D,
  out_proj), its defaults and initialisation; decoding through step() below (its result is
  mamba_simple's step's, its interface membound's).
- Attention: causal (or bidirectional) attention with RoPE and GQA under Llama's names (q_proj,
  k_proj, v_proj, o_proj; no biases), with an optional sliding window.

forward(x [B, T, C]) runs membound.ops on the module's parameters: nn.Linear weights are [out, in]
as PyTorch keeps them and pass to the ops transposed. step(x_t, state) decodes one token per
sequence from decoding_state(batch, ...) (no autograd). CPU tensors (float32, float64, bfloat16).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from . import ops
from ._errors import invalid

__all__ = ["TTTLinear", "TTTMLP", "Mamba", "Attention"]


def _linear(n_in: int, n_out: int, bias: bool, **factory: Any) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=bias, **factory)


class _TTT(nn.Module):
    _mlp = False

    def __init__(self, width: int, heads: int, *, mini_batch: int = 16, use_gate: bool = False,
                 base_lr: float = 1.0, rope_base: float = 10000.0, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        if mini_batch not in ops.TTT_MINI_BATCHES:
            raise invalid("mini_batch", f"one of {ops.TTT_MINI_BATCHES} (the sizes the ops are built for)",
                          mini_batch, "Pick one of those (ttt-lm-pytorch's default is 16)")
        if heads <= 0 or width % heads != 0 or (width // heads) % 2 != 0:
            raise invalid("heads", f"a divisor of width {width} leaving an even head_dim", heads,
                          "Pick heads so that width / heads is even")
        f = {"device": device, "dtype": dtype}
        self.width, self.num_heads, self.head_dim = width, heads, width // heads
        self.mini_batch_size, self.use_gate = mini_batch, use_gate
        self.ttt_base_lr, self.rope_theta = base_lr, rope_base
        C, H, D = width, heads, self.head_dim
        F = 4 * D if self._mlp else D
        self.q_proj, self.k_proj, self.v_proj = (_linear(C, C, False, **f) for _ in range(3))
        self.o_proj = _linear(C, C, False, **f)
        if use_gate:
            self.g_proj = _linear(C, C, False, **f)
        # Upstream's initialisation (TTTBase, TTTLinear/TTTMLP, and _init_weights' normal(0, 0.02)).
        self.learnable_ttt_lr_weight = nn.Parameter(torch.normal(0.0, 0.02, (H, 1, C), **f))
        self.learnable_ttt_lr_bias = nn.Parameter(torch.zeros(H, 1, **f))
        self.learnable_token_idx = nn.Parameter(torch.zeros(mini_batch, **f))
        self.ttt_norm_weight = nn.Parameter(torch.ones(H, D, **f))
        self.ttt_norm_bias = nn.Parameter(torch.zeros(H, D, **f))
        self.post_norm = nn.LayerNorm(C, eps=1e-6, **f)
        self.W1 = nn.Parameter(torch.normal(0.0, 0.02, (H, D, F), **f))
        self.b1 = nn.Parameter(torch.zeros(H, 1, F, **f))
        if self._mlp:
            self.W2 = nn.Parameter(torch.normal(0.0, 0.02, (H, F, D), **f))
            self.b2 = nn.Parameter(torch.zeros(H, 1, D, **f))
        with torch.no_grad():
            for m in (self.q_proj, self.k_proj, self.v_proj, self.o_proj) + ((self.g_proj,) if use_gate else ()):
                m.weight.normal_(0.0, 0.02)

    @classmethod
    def from_config(cls, config: Any, **factory: Any) -> "_TTT":
        """From a ttt-lm-pytorch TTTConfig (or any object with its field names)."""
        for flag in ("share_qk", "pre_conv"):
            if getattr(config, flag, False):
                raise invalid(f"config.{flag}", "False (membound's TTT layer has no convolutions)", True,
                              f"Set {flag}=False")
        return cls(config.hidden_size, config.num_attention_heads, mini_batch=config.mini_batch_size,
                   use_gate=config.use_gate, base_lr=config.ttt_base_lr, rope_base=config.rope_theta, **factory)

    def weights(self) -> list[torch.Tensor]:
        """The parameters in membound.ops' order and layout."""
        H, C = self.num_heads, self.width
        w = [self.q_proj.weight.t(), self.k_proj.weight.t(), self.v_proj.weight.t(), self.ttt_norm_weight,
             self.ttt_norm_bias, self.W1, self.b1.reshape(H, -1), self.learnable_ttt_lr_weight.reshape(H, C),
             self.learnable_ttt_lr_bias.reshape(H), self.learnable_token_idx, self.post_norm.weight,
             self.post_norm.bias]
        if self.use_gate:
            w.append(self.g_proj.weight.t())
        w.append(self.o_proj.weight.t())
        if self._mlp:
            w += [self.W2, self.b2.reshape(H, -1)]
        return w

    def _attrs(self) -> dict[str, Any]:
        return {"heads": self.num_heads, "use_gate": self.use_gate, "base_lr": self.ttt_base_lr,
                "rope_base": self.rope_theta, "mini_batch": self.mini_batch_size}

    def decoding_state(self, batch: int) -> ops.DecodeState:
        """A state for step(): the inner model starts from W1, b1 (W2, b2) as they are now."""
        return ops.decode_state("ttt_mlp" if self._mlp else "ttt_linear", self.weights(), batch=batch, width=self.width,
                                dtype=self.W1.dtype, **self._attrs())

    def step(self, x_t: torch.Tensor, state: ops.DecodeState) -> torch.Tensor:
        """One token per sequence, x_t [batch, width]: forward's row at state.position."""
        return ops.decode_step(x_t, self.weights(), state)

    def forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, T, width]; or packed sequences, x [1, T, width] with cu_seqlens (membound.ops)."""
        op = ops.ttt_mlp if self._mlp else ops.ttt_linear
        return op(x, self.weights(), cu_seqlens=cu_seqlens, **self._attrs())


class TTTLinear(_TTT):
    """TTT-Linear (ttt-lm-pytorch's TTTLinear): the inner model W1 [H, D, D], b1 [H, 1, D]."""


class TTTMLP(_TTT):
    """TTT-MLP (ttt-lm-pytorch's TTTMLP): W1 [H, D, 4D], b1, W2 [H, 4D, D], b2."""

    _mlp = True


class Mamba(nn.Module):
    """The Mamba-1 block under mamba_simple's names, defaults and initialisation."""

    def __init__(self, d_model: int, d_state: int = 16, d_conv: int = 4, expand: int = 2,
                 dt_rank: Any = "auto", dt_min: float = 0.001, dt_max: float = 0.1, dt_init: str = "random",
                 dt_scale: float = 1.0, dt_init_floor: float = 1e-4, conv_bias: bool = True, bias: bool = False,
                 use_fast_path: bool = True, layer_idx: Optional[int] = None, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        # use_fast_path chooses between mamba_ssm's kernels and its reference; membound has one path.
        self.use_fast_path, self.layer_idx = use_fast_path, layer_idx
        if not conv_bias or bias:
            raise invalid("conv_bias, bias", "conv_bias=True, bias=False (mamba_simple's defaults)",
                          (conv_bias, bias), "Use the defaults: membound's block has exactly those parameters")
        if dt_init not in ("random", "constant"):
            raise invalid("dt_init", "'random' or 'constant'", dt_init, "As mamba_simple")
        f = {"device": device, "dtype": dtype}
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.d_inner = expand * d_model
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        Di, R = self.d_inner, self.dt_rank
        self.in_proj = _linear(d_model, 2 * Di, False, **f)
        self.conv1d = nn.Conv1d(Di, Di, d_conv, groups=Di, padding=d_conv - 1, bias=True, **f)
        self.x_proj = _linear(Di, R + 2 * d_state, False, **f)
        self.dt_proj = _linear(R, Di, True, **f)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(Di, 1).to(**f))
        self.A_log._no_weight_decay = True  # as mamba_simple marks them for its optimizer groups
        self.D = nn.Parameter(torch.ones(Di, **f))
        self.D._no_weight_decay = True
        self.out_proj = _linear(Di, d_model, False, **f)
        # mamba_simple's dt_proj initialisation: weights keep the variance at dt_scale, the bias is
        # softplus⁻¹ of dt drawn log-uniformly in [dt_min, dt_max].
        with torch.no_grad():
            std = R ** -0.5 * dt_scale
            if dt_init == "constant":
                self.dt_proj.weight.fill_(std)
            else:
                self.dt_proj.weight.uniform_(-std, std)
            dt = torch.exp(torch.rand(Di) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
            dt = dt.clamp(min=dt_init_floor)
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def weights(self) -> list[torch.Tensor]:
        """The parameters in membound.ops' order and layout."""
        return [self.in_proj.weight.t(), self.conv1d.weight.reshape(self.d_inner, self.d_conv), self.conv1d.bias,
                self.x_proj.weight.t(), self.dt_proj.weight.t(), self.dt_proj.bias, self.A_log, self.D,
                self.out_proj.weight.t()]

    def _attrs(self) -> dict[str, Any]:
        return {"d_inner": self.d_inner, "d_state": self.d_state, "d_conv": self.d_conv, "dt_rank": self.dt_rank}

    def decoding_state(self, batch: int) -> ops.DecodeState:
        """A zero convolution and scan state for step() (mamba_simple's inference cache)."""
        return ops.decode_state("mamba", self.weights(), batch=batch, width=self.d_model, dtype=self.D.dtype,
                                **self._attrs())

    def step(self, x_t: torch.Tensor, state: ops.DecodeState) -> torch.Tensor:
        """One token per sequence, x_t [batch, d_model]: forward's row at state.position (what
        mamba_simple's step computes, over membound's own state)."""
        return ops.decode_step(x_t, self.weights(), state)

    def forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, T, d_model]; or packed sequences, x [1, T, d_model] with cu_seqlens (mamba's seq_idx
        in offset form)."""
        return ops.mamba(x, self.weights(), cu_seqlens=cu_seqlens, **self._attrs())


class Attention(nn.Module):
    """Attention with RoPE (rotate-half, as Llama) and GQA under Llama's projection names."""

    def __init__(self, d_model: int, heads: int, kv_heads: Optional[int] = None, head_dim: Optional[int] = None, *,
                 causal: bool = True, window: int = 0, rope_base: float = 10000.0, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        f = {"device": device, "dtype": dtype}
        self.heads = heads
        self.kv_heads = heads if kv_heads is None else kv_heads
        self.head_dim = d_model // heads if head_dim is None else head_dim
        self.causal, self.window, self.rope_base = causal, window, rope_base
        self.q_proj = _linear(d_model, heads * self.head_dim, False, **f)
        self.k_proj = _linear(d_model, self.kv_heads * self.head_dim, False, **f)
        self.v_proj = _linear(d_model, self.kv_heads * self.head_dim, False, **f)
        self.o_proj = _linear(heads * self.head_dim, d_model, False, **f)

    def weights(self) -> list[torch.Tensor]:
        """The parameters in membound.ops' order and layout."""
        return [self.q_proj.weight.t(), self.k_proj.weight.t(), self.v_proj.weight.t(), self.o_proj.weight.t()]

    def _attrs(self) -> dict[str, Any]:
        return {"heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "causal": self.causal,
                "window": self.window, "rope_base": self.rope_base}

    def decoding_state(self, batch: int, max_len: int) -> ops.DecodeState:
        """A KV cache of max_len positions for step() (the window's last W under a window: flat memory)."""
        return ops.decode_state("attention", self.weights(), batch=batch, width=self.q_proj.in_features,
                                dtype=self.q_proj.weight.dtype, max_len=max_len, **self._attrs())

    def step(self, x_t: torch.Tensor, state: ops.DecodeState) -> torch.Tensor:
        """One token per sequence, x_t [batch, d_model]: causal forward's row at state.position."""
        return ops.decode_step(x_t, self.weights(), state)

    def forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, T, d_model]; or packed sequences, x [1, T, d_model] with cu_seqlens (FlashAttention's
        varlen convention)."""
        return ops.attention(x, self.weights(), cu_seqlens=cu_seqlens, **self._attrs())
