"""Decode attention over the paged KV cache, split along the context (flash-decoding).

One new query token per sequence attends to the `context_len` tokens already in the cache
(its own K/V included). Two kernels:

1. `_decode_split_kernel`, grid `(batch, num_kv_heads, num_splits)`: each program takes one
   contiguous slice of one sequence's context for one KV head and all the query heads that
   share it (GQA), so each K/V tile is loaded once per group. It writes an unnormalised
   partial output plus the running max and sum of exponentials, all in fp32.
2. `_decode_combine_kernel`, grid `(batch, num_heads)`: rescales the partials to a common max
   and normalises.

Every launch and scratch shape depends on tensor shapes only, never on `context_lens` values,
so the pair can be captured in a CUDA graph. A split with no tokens writes the neutral partial
(max=-inf, sum=0, acc=0), and a sequence with context_len 0 comes out as exact zeros.
"""

import functools
import os

import torch
import triton
import triton.language as tl

# Programs we aim to launch for the split kernel: two per SM of an H100 (132 SMs), which keeps
# every SM busy even when programs finish unevenly. The real SM count is used when known.
_DEFAULT_NUM_SMS = 132
_PROGRAMS_PER_SM = 2
# Fewer tokens than this per split costs more in the combine than it gains in parallelism.
_MIN_TOKENS_PER_SPLIT = 128
# Upper bound on splits: the combine kernel holds all of a head's partials ([splits, head_dim]
# fp32) in registers at once.
_MAX_SPLITS = 128

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_NUM_SMS


def default_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """How many slices to cut each sequence's context into, from shapes only.

    Enough splits that `batch * num_kv_heads * num_splits` reaches about two programs per SM,
    but no split shorter than `_MIN_TOKENS_PER_SPLIT` of the longest possible context
    (`max_blocks_per_seq * block_size`), and at least 1.
    """
    target = _PROGRAMS_PER_SM * _num_sms(device)
    wanted = triton.cdiv(target, max(batch * num_kv_heads, 1))
    cap = triton.cdiv(max(max_context, 1), _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, cap, _MAX_SPLITS))


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bt_seq, stride_bt_blk, stride_ctx,
    block_size, group_size, num_heads, head_dim, num_splits,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < group_size
    mask_d = offs_d < head_dim
    heads = kv_head * group_size + offs_g  # query heads sharing this KV head

    # The split length follows this sequence's own length (rounded to whole tiles), so short
    # and long sequences both spread over all their splits; splits past the end stay empty.
    context_len = tl.load(context_lens_ptr + seq * stride_ctx)
    tokens_per_split = (context_len + num_splits - 1) // num_splits
    tokens_per_split = (tokens_per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)

    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    # tl.dot wants both operands in one dtype; the broadcast path works in fp32.
    if USE_DOT:
        q = q.to(DOT_DTYPE)
    else:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    table_row = block_tables_ptr + seq * stride_bt_seq
    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        # Per-token block lookup handles any block_size; masked tokens never touch the table,
        # so entries past ceil(context_len / block_size) (the -1 padding) are never read.
        block_ids = tl.load(table_row + (offs_n // block_size) * stride_bt_blk, mask=mask_n, other=0)
        block_ids = block_ids.to(tl.int64)  # block_id * block stride can pass 2**31
        in_block = offs_n % block_size
        mask_nd = mask_n[:, None] & mask_d[None, :]

        k_rows = block_ids * stride_kb + in_block * stride_kt + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :] * stride_kd,
                    mask=mask_nd, other=0.0)
        if USE_DOT:
            # ieee keeps fp32 caches exact; it is ignored for bf16/fp16 operands.
            scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee")
        else:
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        scores = tl.where(mask_n[None, :], scores * scale, float("-inf"))

        # Online softmax; every tile has at least one real token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_rows = block_ids * stride_vb + in_block * stride_vt + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :] * stride_vd,
                    mask=mask_nd, other=0.0)
        if USE_DOT:
            pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # Scratch layout: [batch, num_heads, num_splits] (+ head_dim for acc), contiguous.
    part_row = (seq * num_heads + heads) * num_splits + split
    tl.store(part_max_ptr + part_row, m_i, mask=mask_g)
    tl.store(part_sum_ptr + part_row, l_i, mask=mask_g)
    tl.store(part_acc_ptr + part_row[:, None] * head_dim + offs_d[None, :], acc,
             mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _decode_combine_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr,
    stride_ob, stride_oh, stride_od,
    num_heads, head_dim, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < head_dim

    row = (seq * num_heads + head) * num_splits + offs_s
    m = tl.load(part_max_ptr + row, mask=mask_s, other=float("-inf"))
    l = tl.load(part_sum_ptr + row, mask=mask_s, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * head_dim + offs_d[None, :],
                  mask=mask_s[:, None] & mask_d[None, :], other=0.0)

    # Empty splits have max=-inf and so weigh exp(-inf) = 0. When every split is empty
    # (context_len 0) the reference max falls back to 0 and the denominator to 1, giving exact
    # zeros without ever forming -inf - -inf or 0 / 0.
    m_max = tl.max(m, axis=0)
    m_ref = tl.where(m_max > float("-inf"), m_max, 0.0)
    weight = tl.exp(m - m_ref)
    denom = tl.sum(weight * l, axis=0)
    numer = tl.sum(weight[:, None] * acc, axis=0)
    result = numer / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od,
             result.to(out_ptr.dtype.element_ty), mask=mask_d)


def _check_args(q, k_cache, v_cache, block_tables, context_lens, out) -> None:
    """Validate shapes and dtypes at the boundary (cheap: no device sync)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, num_heads, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be [batch={batch}, max_blocks_per_seq], got {tuple(block_tables.shape)}"
        )
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens must be [batch={batch}], got {tuple(context_lens.shape)}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError(
            f"block_tables and context_lens must be int32, got {block_tables.dtype} and {context_lens.dtype}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} != v_cache dtype {v_cache.dtype}")
    if out is not None and out.shape != q.shape:
        raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged context (Triton).

    Args:
        q: `[batch, num_heads, head_dim]`, float dtype (any head_dim; padded in-kernel).
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`; any block_size.
            `num_heads` must be a multiple of `num_kv_heads`; query head h reads KV head
            `h // (num_heads // num_kv_heads)`.
        block_tables: `[batch, max_blocks_per_seq]` int32, padded with -1.
        context_lens: `[batch]` int32, tokens to attend to, including the current one (whose
            K/V must already be stored). 0 marks a padding row: its output is zeros and no KV
            or block-table entry is read for it.
        scale: softmax scale, usually `head_dim ** -0.5`.
        num_splits: slices per sequence; default from `default_num_splits` (shapes only).
        out: optional `[batch, num_heads, head_dim]` output buffer (e.g. a CUDA-graph buffer).

    Returns:
        `out` (allocated in q's dtype when not given), `[batch, num_heads, head_dim]`.
    """
    _check_args(q, k_cache, v_cache, block_tables, context_lens, out)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if k_cache.dtype not in _TL_DTYPES:
        raise ValueError(f"cache dtype must be one of {list(_TL_DTYPES)}, got {k_cache.dtype}")
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = default_num_splits(batch, num_kv_heads, max_context, q.device)
    if not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {_MAX_SPLITS}], got {num_splits}")

    group_size = num_heads // num_kv_heads
    # Groups of 3+ query heads are padded to 16 rows and use tl.dot (tensor cores need
    # M >= 16); groups of 1-2 use a broadcast multiply-sum, which wastes no rows.
    use_dot = group_size > 2
    block_g = triton.next_power_of_2(group_size)
    if use_dot:
        block_g = max(16, block_g)
    # tl.dot needs an inner dimension of at least 16.
    block_d = max(16, triton.next_power_of_2(head_dim))
    # The broadcast path holds a [BLOCK_G, BLOCK_N, BLOCK_D] product in registers: keep it small.
    block_n = 64 if use_dot else 32
    dot_dtype = _TL_DTYPES[k_cache.dtype]
    if os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter's tl.dot multiplies bf16's raw uint16 storage; fp32 is exact there.
        dot_dtype = tl.float32

    part_acc = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_max = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    part_sum = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)

    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        part_acc, part_max, part_sum,
        scale,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0), block_tables.stride(1), context_lens.stride(0),
        block_size, group_size, num_heads, head_dim, num_splits,
        BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, USE_DOT=use_dot, DOT_DTYPE=dot_dtype,
    )
    _decode_combine_kernel[(batch, num_heads)](
        part_acc, part_max, part_sum, out,
        out.stride(0), out.stride(1), out.stride(2),
        num_heads, head_dim, num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
    )
    return out


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch twin of `paged_decode_attention` (same contract), for CPU and tests.

    Loops over the batch and syncs on `context_lens`, so it is not graph-capturable.
    Computes in at least fp32 (float64 inputs stay float64, which makes it the test oracle).
    `num_splits` is accepted for signature parity and ignored.
    """
    del num_splits
    _check_args(q, k_cache, v_cache, block_tables, context_lens, out)
    num_heads = q.shape[1]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_heads // num_kv_heads
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    if out is None:
        out = torch.empty_like(q)

    for seq, context_len in enumerate(context_lens.tolist()):
        if context_len == 0:
            out[seq].zero_()
            continue
        blocks = block_tables[seq, : -(-context_len // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:context_len].to(compute_dtype)  # [ctx, kv_heads, D]
        v = v_cache[blocks].flatten(0, 1)[:context_len].to(compute_dtype)
        k = k.repeat_interleave(group_size, dim=1)  # [ctx, num_heads, D]
        v = v.repeat_interleave(group_size, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[seq].to(compute_dtype), k) * scale
        probs = torch.softmax(scores, dim=-1)
        out[seq] = torch.einsum("hn,nhd->hd", probs, v).to(out.dtype)
    return out
