"""The small element-wise pieces of a decoder step, written as plain functions so that
torch.compile can fuse each into one kernel (see `fastgen.compile.build_op_set`).

Each follows transformers' arithmetic order and dtype casts, so greedy outputs match it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 and cast back to x's dtype."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm; returns (normed, new residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def apply_rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding (rotate-half layout) for q [T, Hq, D] and k [T, Hk, D].

    cos_sin: float32 [max_positions, D] holding cos in the first half, sin in the second.
    """
    cs = cos_sin.index_select(0, positions)
    half = cs.shape[-1] // 2
    cos = torch.cat([cs[:, :half], cs[:, :half]], dim=-1).unsqueeze(1).to(q.dtype)
    sin = torch.cat([cs[:, half:], cs[:, half:]], dim=-1).unsqueeze(1).to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a merged [.., 2 * I] gate-up projection: silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm with weight and bias over the last dim: the very call nn.LayerNorm makes."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then LayerNorm; returns (normed, new residual)."""
    residual = x + residual
    return layer_norm(residual, weight, bias, eps), residual


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation, written out as transformers' `gelu_new` (GPT-2) is:
    F.gelu(approximate="tanh") rounds differently, and greedy parity needs the same bits."""
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))
