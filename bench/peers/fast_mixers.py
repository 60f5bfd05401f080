"""The hybrid model's mixers as a PyTorch user runs them at their fastest: the honest peer of
issue 40 (model_cuda_peer.py --peer honest). The same weights and the same model as the
reference mixers they subclass (mamba_peer.TorchMamba, ttt_peer.TorchTTT); how it runs differs, and
with it the order of the scan's sums (model_cuda_peer.py --verify bounds the difference).

- Mamba: mamba_ssm's fused training path (`mamba_inner_fn`: causal_conv1d's kernel, the selective
  scan's CUDA kernels, the projections), what mamba_simple.Mamba runs with use_fast_path,
  when mamba_ssm imports and the tensors are on a GPU. Otherwise the strongest scan PyTorch itself
  has: `torch._higher_order_ops.associative_scan` over the (exp(ΔA), ΔBu) pairs, which
  torch.compile lowers to one Triton scan kernel on a GPU (combine_mode "pointwise"); eager
  ("generic") on the CPU. Which one ran is `mamba_backend()`.
- TTT-Linear / TTT-MLP: ttt-lm-pytorch's dual form with its mini-batch function compiled
  (torch.compile, fullgraph) and the scan over mini-batches left in Python: compiling the whole
  loop unrolls T/16 mini-batches into one graph (minutes of compile at T = 2k, more at 16k).
  flash-linear-attention's TTT kernel computes a different model (a per-token learning rate), so
  it is a peer for the layer benchmark only, not for this model.
- Attention: attention_peer.TorchAttention already calls F.scaled_dot_product_attention; the
  backend (flash, cuDNN, efficient) is chosen around the step (model_cuda_peer.py --sdpa).
"""
import torch
import torch.nn.functional as F

import mamba_peer as MP
import ttt_peer as TP


def _mamba_inner_fn():
    try:
        from mamba_ssm.ops import selective_scan_interface as ssi
    except Exception:  # not installed, or built for another torch: the fallback below runs
        return None
    # mamba_inner_fn needs causal_conv1d's kernel too, which upstream imports optionally: as
    # causal_conv1d_fwd_function from 2.3 (causal_conv1d.cpp_functions), causal_conv1d_cuda before.
    conv = getattr(ssi, "causal_conv1d_fwd_function", None) or getattr(ssi, "causal_conv1d_cuda", None)
    return ssi.mamba_inner_fn if conv is not None else None


def mamba_backend(device):
    """What FastMamba runs on `device`: "mamba_ssm" (its CUDA kernels) or "associative_scan"."""
    return "mamba_ssm" if device == "cuda" and _mamba_inner_fn() is not None else "associative_scan"


def _combine(x, y):
    a1, b1 = x
    a2, b2 = y
    return a1 * a2, a2 * b1 + b2


def selective_scan_assoc(u, delta, A, B, C, D, z, delta_bias):
    """selective_scan_ref's result (delta_softplus, real A, variable B and C) through one
    associative scan over the time axis: u, delta, z [b, Di, l]; B, C [b, Ns, l]."""
    from torch._higher_order_ops.associative_scan import associative_scan
    dtype_in = u.dtype
    u, delta = u.float(), F.softplus(delta.float() + delta_bias[..., None].float())
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B.float(), u)
    mode = "pointwise" if u.is_cuda else "generic"
    _, h = associative_scan(_combine, (dA, dBu), dim=2, combine_mode=mode)
    y = torch.einsum("bdln,bnl->bdl", h, C.float())
    out = (y + u * D[:, None]) * F.silu(z)  # as selective_scan_ref: the gate in z's own type
    return out.to(dtype_in)


class FastMamba(MP.TorchMamba):
    def forward(self, hidden):
        b, l, _ = hidden.shape
        A = -torch.exp(self.A_log.float())
        inner = _mamba_inner_fn() if hidden.is_cuda else None
        if inner is not None:  # mamba_simple.Mamba.forward's fast path, verbatim in effect
            xz = (self.in_proj.weight @ hidden.reshape(b * l, -1).T).reshape(2 * self.Di, b, l).permute(1, 0, 2)
            return inner(xz, self.conv1d.weight, self.conv1d.bias, self.x_proj.weight, self.dt_proj.weight,
                         self.out_proj.weight, None, A, None, None, self.D.float(),
                         delta_bias=self.dt_proj.bias.float(), delta_softplus=True)
        Di, N, R = self.Di, self.N, self.R
        xz = self.in_proj(hidden).permute(0, 2, 1)                # [b, 2 Di, l]
        x, z = xz.chunk(2, dim=1)
        x = self.act(self.conv1d(x)[..., :l])
        x_dbl = self.x_proj(x.permute(0, 2, 1).reshape(b * l, Di))
        dt, Bm, Cm = torch.split(x_dbl, [R, N, N], dim=-1)
        dt = (dt @ self.dt_proj.weight.T).reshape(b, l, Di).permute(0, 2, 1)
        Bm = Bm.reshape(b, l, N).permute(0, 2, 1)
        Cm = Cm.reshape(b, l, N).permute(0, 2, 1)
        y = selective_scan_assoc(x, dt, A, Bm, Cm, self.D.float(), z, self.dt_proj.bias)
        return self.out_proj(y.permute(0, 2, 1))


class FastTTT(TP.TorchTTT):
    """The dual form with its mini-batch step compiled once per module (same shapes every call)."""

    def __init__(self, *args, compile_step=True, **kwargs):
        super().__init__(*args, **kwargs)
        step = super().compute_mini_batch
        self._step = torch.compile(step, fullgraph=True, dynamic=False) if compile_step else step

    def compute_mini_batch(self, params, inputs):
        return self._step(params, inputs)

    @torch.compiler.disable  # the scan stays a Python loop over compiled mini-batches
    def forward(self, x):
        return super().forward(x)
