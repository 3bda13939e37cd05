"""The attention layer: prepares q/k, stores this step's K/V into its slice of the paged cache,
then attends. How many launches that takes is the backend's business (one fused kernel on
CUDA, separate torch ops on CPU); this layer never asks which device it runs on."""

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

    def forward(self, q, k, v, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                positions: torch.Tensor | None = None, cos_sin: torch.Tensor | None = None,
                qk_norm: tuple | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, KV, D] as projected -> [T, H, D].

        For rotary models: positions [T] and cos_sin, the rotary table, and optionally qk_norm,
        (q weight, k weight, eps) of a per-head RMSNorm applied before RoPE (Qwen3); the backend
        prepares q/k and stores K/V in one go. Without cos_sin (learned positions, GPT-2), q and
        k are used as given and K/V are only stored.
        """
        if cos_sin is None:
            self.backend.store(k, v, k_cache, v_cache, meta)
        else:
            q_weight, k_weight, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
            if not meta.is_prefill and not meta.several_rows_a_sequence:
                return self.backend.rope_store_and_decode(positions, q, k, v, cos_sin, q_weight, k_weight, eps,
                                                          k_cache, v_cache, meta, self.scale)
            q, k = self.backend.rope_and_store(positions, q, k, v, cos_sin, q_weight, k_weight, eps,
                                               k_cache, v_cache, meta)
        if meta.is_prefill:
            return self.backend.prefill(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.backend.decode(q, k_cache, v_cache, meta, self.scale)
