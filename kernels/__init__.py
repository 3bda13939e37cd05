"""fastgen's Triton kernels, imported as `fastgen.kernels`: the paged-KV-cache store, the fused
q/k-norm + RoPE + KV store, split-KV decode attention and paged prefill attention.

Each attention kernel has a plain-torch twin with the same contract (`*_torch`), used as the
oracle in tests. The decode-path kernels launch with shapes that depend only on tensor shapes,
so they can be captured in CUDA graphs.
"""

from .paged_attention_torch import paged_decode_attention_torch, paged_prefill_attention_torch
from .paged_decode_attention import paged_decode_attention
from .paged_prefill_attention import paged_prefill_attention
from .qk_norm_rope_store import qk_norm_rope_store
from .store_kvcache import store_kvcache, store_kvcache_torch

__all__ = [
    "paged_decode_attention",
    "paged_decode_attention_torch",
    "paged_prefill_attention",
    "paged_prefill_attention_torch",
    "qk_norm_rope_store",
    "store_kvcache",
    "store_kvcache_torch",
]
