"""RMSNorm and LayerNorm whose arithmetic comes from the (possibly compiled) op set.

Both take an optional residual: with one, the residual add is fused into the norm and the new
residual is returned beside the normed value, so a decoder layer is norm(x, residual) → block.
"""

from __future__ import annotations

import torch
from torch import nn

from fastgen.compile import OpSet


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: OpSet):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: the normed x. With residual: (normed x + residual, x + residual)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

    def project(self, x: torch.Tensor, residual: torch.Tensor | None, linear: nn.Module, swiglu: bool = False):
        """`linear` applied to this norm's output, and SwiGLU of its two halves with `swiglu`,
        the residual handled as `forward` handles it: returns (output, new residual), the new
        residual being x itself when there is none yet. One launch where the linear layer's
        product can take the norm in (`QuantizableWeight.rms_norm_product`), the ops in turn
        elsewhere."""
        fused = linear.rms_norm_product(x, residual, self.weight, self.eps, linear.bias, swiglu)
        if fused is not None:
            return fused
        if residual is None:
            normed, residual = self(x), x
        else:
            normed, residual = self(x, residual)
        y = linear(normed)
        return (self.ops.silu_and_mul(y) if swiglu else y), residual


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (GPT-2), over the last dim."""

    def __init__(self, size: int, eps: float, ops: OpSet):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: the normed x. With residual: (normed x + residual, x + residual)."""
        if residual is None:
            return self.ops.layer_norm(x, self.weight, self.bias, self.eps)
        return self.ops.add_layer_norm(x, residual, self.weight, self.bias, self.eps)
