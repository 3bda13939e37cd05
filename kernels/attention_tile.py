"""What the paged prefill and decode kernels share: one K/V tile read through the block table and
folded into an online softmax, the tile masks, and the launch strides."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_mask(mask_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Mask of a [rows, BLOCK_D] tile; the head-dim part only when BLOCK_D pads HEAD_DIM, so
    that full-width rows stay unmasked along the contiguous axis (vector loads)."""
    if BLOCK_D == HEAD_DIM:
        return mask_rows[:, None]
    else:
        return mask_rows[:, None] & (offs_d < HEAD_DIM)[None, :]


@triton.jit
def attend_tile(
    acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_row, kv_head, scale,
    tile_start, end, last_visible,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Fold keys [tile_start, min(tile_start + BLOCK_N, end)) of one sequence into the online
    softmax of q's rows ([rows, BLOCK_D], in DOT_DTYPE); row r sees keys <= last_visible[r].

    acc [rows, BLOCK_D], m_i and l_i [rows] are fp32. A row must see some key in its first
    tile (so m_i is finite from then on); a later tile it cannot see adds exp(-inf) = 0.
    Returns the new (acc, m_i, l_i).
    """
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tile_start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    k_rows, v_rows = kv_tile_rows(table_row, kv_head, offs_n, mask_n, stride_kb, stride_kt, stride_kh,
                                  stride_vb, stride_vt, stride_vh, BLOCK_SIZE)
    kv_mask = row_mask(mask_n, offs_d, HEAD_DIM, BLOCK_D)
    k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    # ieee keeps fp32 caches exact; bf16/fp16 operands run on tensor cores either way.
    scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee") * scale
    visible = (offs_n[None, :] <= last_visible[:, None]) & mask_n[None, :]
    scores = tl.where(visible, scores, float("-inf"))
    v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    return softmax_fold(acc, m_i, l_i, scores, v, DOT_DTYPE)


@triton.jit
def kv_tile_rows(table_row, kv_head, offs_n, mask_n, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                 stride_vh, BLOCK_SIZE: tl.constexpr):
    """Where tokens offs_n's K and V rows of `kv_head` start in the paged caches (element
    offsets, int64), through one sequence's block-table row."""
    # Masked tokens never read the table, so its -1 padding is never dereferenced; int64 because
    # block_id * block stride passes 2**31 on large caches.
    block_ids = tl.load(table_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    in_block = offs_n % BLOCK_SIZE
    return (block_ids * stride_kb + in_block * stride_kt + kv_head * stride_kh,
            block_ids * stride_vb + in_block * stride_vt + kv_head * stride_vh)


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, table_row, kv_head, tile_start, end,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Keys and values [tile_start, tile_start + BLOCK_N) of one sequence, both asked for at once
    (the decode kernel's round trips are its time): (offs_n, mask_n: offs_n < end, k, v), k and
    v [BLOCK_N, BLOCK_D] in the cache's dtype, zeros where masked."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tile_start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    k_rows, v_rows = kv_tile_rows(table_row, kv_head, offs_n, mask_n, stride_kb, stride_kt, stride_kh,
                                  stride_vb, stride_vt, stride_vh, BLOCK_SIZE)
    kv_mask = row_mask(mask_n, offs_d, HEAD_DIM, BLOCK_D)
    k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    return offs_n, mask_n, k, v


@triton.jit
def fold_kv_tile(acc, m_i, l_i, q, k, v, mask_n, scale, DOT_DTYPE: tl.constexpr):
    """`attend_tile` for a tile already loaded (`load_kv_tile`) whose unmasked keys every row
    sees (decode: one query a sequence). The tile must hold some unmasked key."""
    scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee") * scale
    scores = tl.where(mask_n[None, :], scores, float("-inf"))
    return softmax_fold(acc, m_i, l_i, scores, v, DOT_DTYPE)


@triton.jit
def softmax_fold(acc, m_i, l_i, scores, v, DOT_DTYPE: tl.constexpr):
    """One tile's scores [rows, keys] (-inf where not seen) and values [keys, BLOCK_D] folded
    into the running (acc, m_i, l_i)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
    return acc, m_new, l_i


def paged_strides(q, k_cache, v_cache, out, block_tables) -> tuple[int, ...]:
    """The stride arguments both attention kernels take, in their order: q (token, head), k and v
    caches (block, slot, head), out (token, head), block-table row. Head dims are unit-stride."""
    return (q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            out.stride(0), out.stride(1), block_tables.stride(0))
