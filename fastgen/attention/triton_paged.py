"""CUDA without flash-attn: fastgen's Triton kernels for every step.

q/k-norm + RoPE + KV store is one fused launch a layer (inside the decode kernel's at decode
steps); prefill (fresh prompts, later chunks
and prefix-cache hits alike) reads K/V straight from the paged cache with bounded memory; decode
is split-KV attention whose splits follow the batch's lengths.
"""

from __future__ import annotations

import torch

from fastgen.attention.backend import rope_store_then_decode
from fastgen.attention.metadata import AttentionMetadata
from fastgen.kernels import paged_decode_attention, paged_prefill_attention, qk_norm_rope_store, store_kvcache
from fastgen.kernels.paged_decode_attention import NewToken


# A switch so that benchmarks can compare the decode kernel preparing the new token with the
# two launches (`benchmarks/gpu_decode.py --decode-new-token off`).
DECODE_PREPARES_NEW_TOKEN = True


class TritonPagedBackend:
    name = "triton"

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta  # the kernels read block tables and lengths directly

    def rope_and_store(self, positions, q, k, v, cos_sin, q_norm_weight, k_norm_weight, norm_eps,
                       k_cache, v_cache, meta: AttentionMetadata):
        return qk_norm_rope_store(q, k, v, positions, cos_sin, q_norm_weight, k_norm_weight, norm_eps,
                                  k_cache, v_cache, meta.slot_mapping)

    def rope_store_and_decode(self, positions, q, k, v, cos_sin, q_norm_weight, k_norm_weight, norm_eps,
                              k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # One launch fewer a layer: the decode kernel prepares and stores the new token itself.
        if not DECODE_PREPARES_NEW_TOKEN:
            return rope_store_then_decode(self, positions, q, k, v, cos_sin, q_norm_weight, k_norm_weight, norm_eps,
                                          k_cache, v_cache, meta, scale)
        new_token = NewToken(k, v, positions, cos_sin, q_norm_weight, k_norm_weight, norm_eps, meta.slot_mapping)
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                      new_token=new_token)

    def store(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # The new tokens' K/V were stored by rope_and_store: everything the chunk sees is in the cache.
        return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                       meta.context_lens, meta.max_query_len, scale)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
