"""The attention backend interface and the choice of one at start-up."""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Protocol

import torch

from fastgen.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from fastgen.compile import OpSet

logger = logging.getLogger(__name__)

# flash-attn's paged kernels address the cache in pages of a multiple of 256 tokens.
FLASH_ATTN_BLOCK_MULTIPLE = 256


class AttentionBackend(Protocol):
    """Prepares q/k, writes new K/V into a layer's paged cache and attends over it.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim];
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]. Attention returns
    [T, num_heads, head_dim].
    """

    name: str

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Once a step, before the forward: the metadata with whatever this backend derives
        from it for every layer (returned unchanged by backends that need nothing)."""
        ...

    def rope_and_store(self, positions, q, k, v, cos_sin, q_norm_weight, k_norm_weight, norm_eps,
                       k_cache, v_cache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """RMS-normalise q and k per head (when the weights are given, Qwen3), rotate them
        (cos_sin: float32 [max_positions, head_dim], cos | sin), store k and v at
        meta.slot_mapping (-1: nothing). Returns the new (q, k); a backend may rewrite q and k
        in place."""
        ...

    def store(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        """Store k and v at meta.slot_mapping (-1: nothing), for models without rotary embedding."""
        ...

    def rope_store_and_decode(self, positions, q, k, v, cos_sin, q_norm_weight, k_norm_weight, norm_eps,
                              k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """A decode step's attention from the projections: `rope_and_store`, then `decode`, in
        as few launches as the backend has for the pair (`rope_store_then_decode` where it has
        none)."""
        ...

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor: ...

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


def rope_store_then_decode(backend: AttentionBackend, positions, q, k, v, cos_sin, q_norm_weight, k_norm_weight,
                           norm_eps, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """`rope_store_and_decode` as its two steps, for backends without a kernel doing both."""
    q, _ = backend.rope_and_store(positions, q, k, v, cos_sin, q_norm_weight, k_norm_weight, norm_eps,
                                  k_cache, v_cache, meta)
    return backend.decode(q, k_cache, v_cache, meta, scale)


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_backend_name(name: str, device: torch.device) -> str:
    """'auto' -> torch on CPU; on CUDA flash-attn when installed, else triton."""
    if name != "auto":
        return name
    if device.type != "cuda":
        return "torch"
    return "flash-attn" if flash_attn_available() else "triton"


def select_backend(device: torch.device, block_size: int, ops: OpSet, name: str = "auto") -> AttentionBackend:
    """The backend for this engine (the config checked the name against the device)."""
    name = resolve_backend_name(name, device)
    if name == "torch":
        from fastgen.attention.torch_paged import TorchPagedBackend

        return TorchPagedBackend(ops, block_size)
    if name == "flash-attn":
        if block_size % FLASH_ATTN_BLOCK_MULTIPLE != 0:
            raise ValueError(
                f"block_size={block_size} must be a multiple of {FLASH_ATTN_BLOCK_MULTIPLE} "
                "when flash-attn is installed (its paged KV layout requires it)"
            )
        from fastgen.attention.flash import FlashAttnBackend

        return FlashAttnBackend()
    from fastgen.attention.triton_paged import TritonPagedBackend

    return TritonPagedBackend()
