"""RMSNorm whose arithmetic comes from the (possibly compiled) op set."""

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
