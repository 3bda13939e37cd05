"""CUDA without flash-attn: fastgen's Triton kernels for the KV store and decode attention;
prefill stays the eager torch SDPA path over the paged history (prefix caching still works)."""

from __future__ import annotations

import torch

from fastgen.attention.metadata import AttentionMetadata
from fastgen.attention.torch_paged import TorchPagedBackend
from fastgen.kernels import paged_decode_attention, store_kvcache


class TritonPagedBackend(TorchPagedBackend):
    name = "triton"

    def store(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
