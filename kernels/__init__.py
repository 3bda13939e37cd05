"""fastgen's Triton kernels, imported as `fastgen.kernels`: the paged-KV-cache store and
split-KV decode attention.

Each kernel has a plain-torch twin with the same signature (`*_torch`), used on CPU and as
the oracle in tests. The Triton versions launch with shapes that depend only on tensor shapes,
so they can be captured in CUDA graphs.
"""

from .paged_decode_attention import paged_decode_attention, paged_decode_attention_torch
from .store_kvcache import store_kvcache, store_kvcache_torch

__all__ = [
    "paged_decode_attention",
    "paged_decode_attention_torch",
    "store_kvcache",
    "store_kvcache_torch",
]
