"""The attention layer: stores this step's K/V into its slice of the paged cache, then attends."""

from __future__ import annotations

import torch
from torch import nn

from fastgen.attention import AttentionBackend, AttentionMetadata


class PagedAttention(nn.Module):
    """One layer's attention over its own cache slice, which the step hands down with the
    metadata (`k_cache` / `v_cache`: [num_blocks, block_size, num_kv_heads, head_dim]).

    scale: what q·k is multiplied by before the softmax; head_dim ** -0.5 unless given.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend,
                 scale: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.backend = backend

    def forward(self, q, k, v, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, KV, D] -> [T, H, D]."""
        self.backend.store(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill:
            return self.backend.prefill(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.backend.decode(q, k_cache, v_cache, meta, self.scale)
