"""CUDA with flash-attn installed: its paged varlen kernel for prefill and its KV-cache kernel
for decode; q/k preparation and the KV store are fastgen's fused Triton kernel (it skips slot -1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from fastgen.attention.backend import rope_store_then_decode
from fastgen.attention.metadata import AttentionMetadata
from fastgen.attention.triton_paged import TritonPagedBackend


class FlashAttnBackend(TritonPagedBackend):
    name = "flash-attn"

    def rope_store_and_decode(self, *args, **kwargs) -> torch.Tensor:
        # flash-attn's decode kernel attends: q/k preparation and the store stay a launch apart.
        return rope_store_then_decode(self, *args, **kwargs)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # Everything the queries see is in the cache by now (new K/V were stored first), so one
        # paged call covers prompts with and without prefix-cached history.
        cu_seqlens_k = F.pad(meta.context_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_context_len,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables,
        )

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = flash_attn_with_kvcache(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=meta.context_lens,
            block_table=meta.block_tables,
            softmax_scale=scale,
            causal=True,
        )
        return out.squeeze(1)
