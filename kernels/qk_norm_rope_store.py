"""One launch for what a layer does to q, k and v before attention: Qwen3's per-head RMSNorm
of q and k (optional), rotary embedding of both, and the store of k and v into the paged cache.

Unfused, that is up to five launches a layer (q-norm, k-norm, RoPE, KV store, and the casts
between them). The arithmetic follows the torch ops it replaces (`fastgen.compile.ops`), rounding
to the activation dtype where eager torch does: the norm in fp32, cast, times the weight; the
cos/sin table cast to the activation dtype; each RoPE product and the sum rounded.

q and k are rewritten in place (they are views into the fused QKV projection's output, which
nothing else reads); slot -1 stores nothing for that token (CUDA-graph padding rows,
prefix-cached tokens). One program per token; shapes only, so the launch is graph-capturable.
On Hopper it launches as a programmatic dependent (`programmatic_launch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .programmatic_launch import gdc_launch_dependents, gdc_wait, launch_options, programmatic_launch
from .store_kvcache import check_store_args


@triton.jit
def _norm_rope_in_place(base_ptr, stride_h, weight_ptr, eps, cos, sin,
                        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, QK_NORM: tl.constexpr):
    """Normalise (if QK_NORM) and rotate one token's heads in place; return the two rotated
    halves [BLOCK_H, BLOCK_HALF] in the activation dtype."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = base_ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs < HALF)[None, :]
    lo_ptrs = base_ptr + offs_h[:, None] * stride_h + offs[None, :]
    x1 = tl.load(lo_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
        inv_rms = tl.rsqrt(variance + eps)[:, None]
        w1 = tl.load(weight_ptr + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # Rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    lo = ((x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    hi = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    tl.store(lo_ptrs, lo, mask=mask)
    tl.store(lo_ptrs + HALF, hi, mask=mask)
    return lo, hi


@triton.jit
def qk_norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr,
    k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr, QK_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    if PDL:  # every input comes from the kernels in front: nothing to do before they finish
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_HALF)
    table_row = cos_sin_ptr + tl.load(positions_ptr + token) * stride_cs
    # Eager torch casts the fp32 table to the activation dtype before multiplying.
    cos = tl.load(table_row + offs, mask=offs < HALF, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(table_row + HALF + offs, mask=offs < HALF, other=0.0).to(dtype).to(tl.float32)[None, :]

    _norm_rope_in_place(q_ptr + token * stride_qt, stride_qh, q_weight_ptr, eps, cos, sin,
                        NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_HALF, QK_NORM)
    k_lo, k_hi = _norm_rope_in_place(k_ptr + token * stride_kt, stride_kh, k_weight_ptr, eps, cos, sin,
                                     NUM_KV_HEADS, HEAD_DIM, BLOCK_KV, BLOCK_HALF, QK_NORM)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_KV)
        mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs < HALF)[None, :]
        # The cache is contiguous: a slot's row is NUM_KV_HEADS * HEAD_DIM elements long.
        row = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs[None, :]
        tl.store(k_cache_ptr + row, k_lo, mask=mask)
        tl.store(k_cache_ptr + row + HALF, k_hi, mask=mask)
        v_ptrs = v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs[None, :]
        tl.store(v_cache_ptr + row, tl.load(v_ptrs, mask=mask), mask=mask)
        tl.store(v_cache_ptr + row + HALF, tl.load(v_ptrs + HALF, mask=mask), mask=mask)


def check_qk_norm_rope_args(q, k, v, positions, cos_sin, q_norm_weight, k_norm_weight, k_cache, v_cache,
                            slot_mapping) -> None:
    """Validate what `qk_norm_rope_store` (and decode attention preparing its new token) takes."""
    check_store_args(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, _, head_dim = q.shape
    if q.dtype != k.dtype or q.shape[::2] != k.shape[::2] or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not pair with k {tuple(k.shape)} {k.dtype} "
                         "(same tokens, dtype and even head_dim)")
    if positions.shape != (num_tokens,) or cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim:
        raise ValueError(f"positions must be [{num_tokens}] and cos_sin [max_positions, {head_dim}], got "
                         f"{tuple(positions.shape)} and {tuple(cos_sin.shape)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight come together or not at all")
    for name, t in (("q", q), ("k", k), ("v", v), ("cos_sin", cos_sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride along its last dim, got strides {t.stride()}")


def qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise (when weights are given) and rotate q and k in place, and store k and v (Triton).

    Args:
        q: `[T, num_heads, head_dim]`; k, v: `[T, num_kv_heads, head_dim]`; one float dtype, the
            cache's; unit stride along head_dim (views into a fused QKV output are fine).
        positions: `[T]` int64 token positions. cos_sin: float32 `[max_positions, head_dim]`,
            cos in the first half of a row, sin in the second (rotate-half RoPE).
        q_norm_weight, k_norm_weight: `[head_dim]` RMSNorm weights, both or neither; eps: its epsilon.
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous.
        slot_mapping: `[T]` int32/int64 cache slots; -1 stores nothing.

    Returns:
        (q, k), the same tensors, now normalised and rotated.
    """
    check_qk_norm_rope_args(q, k, v, positions, cos_sin, q_norm_weight, k_norm_weight, k_cache, v_cache,
                            slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return q, k
    qk_norm = q_norm_weight is not None
    pdl = programmatic_launch(q.device)
    qk_norm_rope_store_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin,
        q_norm_weight if qk_norm else cos_sin, k_norm_weight if qk_norm else cos_sin,  # unread without norm
        k_cache, v_cache, slot_mapping,
        eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), QK_NORM=qk_norm, PDL=pdl,
        num_warps=4, **launch_options(pdl),
    )
    return q, k
