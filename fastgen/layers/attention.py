"""The attention layer: stores this step's K/V into its slice of the paged cache, then attends."""

from __future__ import annotations

import torch
from torch import nn

from fastgen.attention import AttentionBackend, AttentionMetadata


class PagedAttention(nn.Module):
    """One layer's view of the cache. `k_cache` / `v_cache` ([num_blocks, block_size,
    num_kv_heads, head_dim]) are bound once by the runner after it allocates the cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, KV, D] -> [T, H, D]."""
        self.backend.store(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.is_prefill:
            return self.backend.prefill(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return self.backend.decode(q, self.k_cache, self.v_cache, meta, self.scale)
