"""The attention backend interface and the choice of one at start-up."""

from __future__ import annotations

import importlib.util
import logging
from typing import Protocol

import torch

from fastgen.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# flash-attn's paged kernels address the cache in pages of a multiple of 256 tokens.
FLASH_ATTN_BLOCK_MULTIPLE = 256


class AttentionBackend(Protocol):
    """Writes new K/V into a layer's paged cache and attends over it.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim];
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]. Returns [T, num_heads, head_dim].
    """

    name: str

    def store(self, k, v, k_cache, v_cache, slot_mapping) -> None: ...

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor: ...

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def select_backend(device: torch.device, block_size: int) -> AttentionBackend:
    """CPU: plain torch. CUDA: flash-attn when installed, else fastgen's Triton kernels."""
    from fastgen.attention.torch_paged import TorchPagedBackend

    if device.type != "cuda":
        return TorchPagedBackend()
    if flash_attn_available():
        if block_size % FLASH_ATTN_BLOCK_MULTIPLE != 0:
            raise ValueError(
                f"block_size={block_size} must be a multiple of {FLASH_ATTN_BLOCK_MULTIPLE} "
                "when flash-attn is installed (its paged KV layout requires it)"
            )
        from fastgen.attention.flash import FlashAttnBackend

        return FlashAttnBackend()
    from fastgen.attention.triton_paged import TritonPagedBackend

    return TritonPagedBackend()
