"""Rotary position embedding tables, with Llama 3's frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, as transformers computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"rope_scaling type={kind!r} is not supported; supported: 'linear', 'llama3'")


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band between
    # the two thresholds blends smoothly from one to the other.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(in_band, blended, scaled)


# The shortest RoPE table built: every max_model_len up to it gets the same table, so the same
# compiled CPU steps (whose saved graphs are keyed by every buffer's shape).
MIN_ROPE_TABLE_POSITIONS = 4096


def rope_table_positions(max_model_len: int, model_limit: int) -> int:
    """Positions the RoPE table holds: max_model_len rounded up to a power of two, at least
    MIN_ROPE_TABLE_POSITIONS, at most the model's own limit (a table of float32 [positions,
    head_dim]: 2 MiB at 4,096 positions and head_dim 128). Rounding up keeps a new max_model_len
    from changing the compiled steps' shapes."""
    bucket = max(MIN_ROPE_TABLE_POSITIONS, 1 << (max_model_len - 1).bit_length())
    return max(max_model_len, min(bucket, model_limit))


class RotaryEmbedding(nn.Module):
    """Holds a float32 [max_positions, head_dim] table of cos | sin (rotate-half layout); the
    attention backend applies it to q and k, fused with the KV store where it can."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
