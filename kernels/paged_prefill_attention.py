"""Prefill attention straight from the paged KV cache, for chunks and prefix-cache hits alike.

Each sequence computes a chunk of `q_len` new tokens that sit at the end of its `context_len`
tokens (earlier chunks or prefix-cached blocks come first); every one of those tokens' K/V is
already in the cache (the new ones were stored just before). Query j of a chunk sits at
position `context_len - q_len + j` and attends to keys 0..that position: the whole history,
causal within the chunk. Like vLLM's prefix-prefill kernel, K/V tiles are read through the
block table inside the kernel, so memory stays O(tokens x heads x head_dim) whatever the
history, where a masked SDPA call materialises [heads, q_len, context_len] fp32 scores.

Grid: (batch, num_heads, ceil(max_query_len / BLOCK_M)); a program computes BLOCK_M queries of
one head with an online softmax over BLOCK_N-token K/V tiles, both products on `tl.dot`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_tile import attend_tile, paged_strides, row_mask
from .triton_types import dot_dtype


@triton.jit
def prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr, out_ptr,
    scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    first = tl.program_id(2) * BLOCK_M  # first query of this tile, within the chunk
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if first >= q_len:  # this sequence's chunk is shorter than the longest one
        return
    history = tl.load(context_lens_ptr + seq) - q_len

    offs_m = first + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    tokens = (q_start + offs_m).to(tl.int64)  # rows of q and out
    q_mask = row_mask(mask_m, offs_d, HEAD_DIM, BLOCK_D)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0).to(DOT_DTYPE)
    positions = history + offs_m  # each query sees keys 0..its position
    kv_head = head // GROUP

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    end = history + tl.minimum(first + BLOCK_M, q_len)  # keys this tile's last query sees
    # Key 0 is visible to every row, so each row's first tile gives it a finite max.
    for tile_start in range(0, end, BLOCK_N):
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_row, kv_head, scale,
                                    tile_start, end, positions,
                                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                    BLOCK_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_DTYPE)

    out = acc / l_i[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def check_prefill_args(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out) -> None:
    """Validate shapes, dtypes and layouts at the boundary (cheap: no device sync)."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"q must be [tokens, num_heads, head_dim] and k_cache, v_cache both "
            f"[num_blocks, block_size, num_kv_heads, head_dim]; got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if k_cache.shape[3] != q.shape[2] or q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache's heads/head_dim {tuple(k_cache.shape[2:])}")
    batch = context_lens.shape[0]
    if query_start_loc.shape != (batch + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"for {batch} sequences query_start_loc must be [{batch + 1}] and block_tables [{batch}, W]; got "
            f"{tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}"
        )
    if {block_tables.dtype, query_start_loc.dtype, context_lens.dtype} != {torch.int32}:
        raise ValueError("block_tables, query_start_loc and context_lens must be int32")
    if out is not None and out.shape != q.shape:
        raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride along head_dim, got strides {t.stride()}")
    if block_tables.stride(1) != 1 or not (query_start_loc.is_contiguous() and context_lens.is_contiguous()):
        raise ValueError("block_tables rows, query_start_loc and context_lens must be contiguous")


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context (Triton).

    Args:
        q: `[T, num_heads, head_dim]`, the new tokens of all sequences end to end; unit stride
            along head_dim (views into a fused QKV projection are fine).
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, any block_size;
            they must already hold every context token's K/V, the new ones included.
        block_tables: `[batch, max_blocks_per_seq]` int32, padded with -1 (never read past
            ceil(context_len / block_size)).
        query_start_loc: `[batch + 1]` int32 offsets of each sequence's tokens in q.
        context_lens: `[batch]` int32, history + new tokens of each sequence (>= its q_len).
        max_query_len: the longest chunk (host int: sizes the grid).
        scale: softmax scale. out: optional `[T, num_heads, head_dim]` buffer.

    Returns:
        `out` (allocated in q's dtype when not given).
    """
    check_prefill_args(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(q)
    batch = context_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    # fp32 (tests) multiplies on CUDA cores, not tensor cores: smaller tiles keep it in registers.
    block_m, block_n = (32, 32) if k_cache.element_size() >= 4 else (64, 64)
    grid = (batch, num_heads, triton.cdiv(max_query_len, block_m))
    prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out,
        scale,
        *paged_strides(q, k_cache, v_cache, out, block_tables),
        BLOCK_SIZE=block_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_DTYPE=dot_dtype(k_cache.dtype),
        num_warps=4,
    )
    return out
