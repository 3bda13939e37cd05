"""The two Triton kernels of split-KV paged decode attention (launched by
`paged_decode_attention`, which documents the contract).

1. `decode_split_kernel`, grid (batch, num_kv_heads, grid_splits): one program takes one
   contiguous slice of one sequence's context for one KV head and all the query heads that
   share it, padded to BLOCK_G >= 16 rows so that both products run on `tl.dot` (tensor cores)
   whatever the group size (SGLang does the same). Each K/V tile is loaded once per group. A
   sequence with one split writes its normalised output directly; otherwise the program writes
   an unnormalised fp32 partial plus its running max and sum of exponentials. With NEW_TOKEN
   it also does `qk_norm_rope_store`'s work for the step's token (each program its own q
   heads; the program whose slice holds the new token folds its K/V in from registers, never
   reading them back from the cache, and stores them for the steps after), which saves a
   launch a layer on the path where launches, not bytes, set the time.
2. `decode_combine_kernel`, grid (batch, num_heads), launched only when grid_splits > 1:
   rescales a sequence's partials to a common max and normalises; sequences that used one
   split are skipped. With COMBINE_IN_LAST_SPLIT there is no second launch: each split
   program counts itself done on a per-(sequence, KV head) counter (an atomic), and the one
   that finishes last does the combine for its KV head's query heads (`combine_group`) and
   zeroes the counter for the next launch.

The number of splits a sequence uses comes from its context length, read on the device
(`splits_for`, mirrored by `decode_split_policy.splits_for_lengths`), so a captured graph
re-decides it on every replay. The grid's split count is a runtime argument (one compiled
kernel serves every batch size); only "one split" is a compile-time switch. With PDL (Hopper,
`programmatic_launch`) both launch as programmatic dependents and wait before any load, or,
with EARLY_CACHE_READS, before the first load of what the kernel in front writes: the split
kernel then reads its first keys and values, and the combine its lengths, while that kernel
still runs.
"""

import triton
import triton.language as tl

from .attention_tile import attend_tile, fold_kv_tile, load_kv_tile, row_mask
from .programmatic_launch import gdc_launch_dependents, gdc_wait


@triton.jit
def splits_for(context_len, grid_splits, MIN_TOKENS: tl.constexpr):
    """ceil(context_len / MIN_TOKENS) clamped to [1, grid_splits]."""
    wanted = (context_len + MIN_TOKENS - 1) // MIN_TOKENS
    return tl.minimum(tl.maximum(wanted, 1), grid_splits)


@triton.jit
def norm_rope_rows(row_ptrs, row_ok, offs_d, partner_d, weight_ptr, eps, cos, sin_signed,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, QK_NORM: tl.constexpr):
    """Rows of heads ([rows, BLOCK_D], read at row_ptrs + d) normalised (if QK_NORM) and rotated,
    in their dtype, rounding where `qk_norm_rope_store` does. Rotate-half written per element:
    d takes x[d] cos[d] + sign(d) x[partner(d)] sin[d], partner(d) = (d + HEAD_DIM/2) mod
    HEAD_DIM, sign -1 in the first half (sin_signed carries it)."""
    dtype = row_ptrs.dtype.element_ty
    mask = row_mask(row_ok, offs_d, HEAD_DIM, BLOCK_D)
    x = tl.load(row_ptrs + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row_ptrs + partner_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        d_ok = offs_d < HEAD_DIM
        w = tl.load(weight_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(weight_ptr + partner_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x = (w * (x * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        xp = (wp * (xp * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return ((x * cos).to(dtype).to(tl.float32) + (xp * sin_signed).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def fold_new_key(acc, m_i, l_i, q, k_new, v_new, is_ours, scale, DOT_DTYPE: tl.constexpr):
    """One key and value ([1, BLOCK_D]) folded into the online softmax of q's rows as
    `fold_kv_tile` folds a tile (fp32 sums of DOT_DTYPE operands, p rounded to DOT_DTYPE before
    it weighs v), where is_ours; elsewhere the running values come back as they were. Without
    a branch: a branch carrying acc out cost the one-launch layer a spill (sm_90)."""
    k_row = k_new.to(DOT_DTYPE).to(tl.float32)
    score = tl.where(is_ours, tl.sum(q.to(tl.float32) * k_row, axis=1) * scale, float("-inf"))
    m_new = tl.maximum(m_i, score)
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row that has seen no key yet: weights of 0
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(score - m_ref)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p.to(DOT_DTYPE).to(tl.float32)[:, None] * v_new.to(DOT_DTYPE).to(tl.float32)
    return acc, m_new, l_i


@triton.jit
def decode_split_program(
    seq, kv_head, split,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_oh,
    stride_bt,
    num_heads, num_kv_heads, grid_splits,
    k_new_ptr, v_new_ptr, positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, slot_mapping_ptr, eps,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cs,
    splits_done_ptr,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    ONE_SPLIT: tl.constexpr, MIN_TOKENS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, NEW_TOKEN: tl.constexpr, QK_NORM: tl.constexpr,
    COMBINE_IN_LAST_SPLIT: tl.constexpr, FIRST_N: tl.constexpr, WAIT_AFTER_CACHE_READS: tl.constexpr,
):
    """What the split kernel's program (seq, kv_head, split) does (seq an int64); nothing when
    the sequence uses fewer splits.

    With NEW_TOKEN the new token's key and value are taken from the projection, never read back
    from the cache (its row there is stale until this kernel stores it): the new token is the
    context's last, so the program holding it attends over the cache up to the key before and
    folds the new one in from registers, after the cache's tiles. No program of the step reads
    what another stores.

    FIRST_N > 0 (`EARLY_CACHE_READS`): the split's first FIRST_N keys and values are asked for
    before q. With WAIT_AFTER_CACHE_READS (a programmatic dependent) they, the block table and
    the new token's position and slot are read before `gdc_wait`: no kernel of this step writes
    them (the cache's one write this step, for this layer, is this kernel's own), so their
    round trips run while q|k|v still computes, and what is left after the wait is q's."""
    context_len = tl.load(context_lens_ptr + seq)
    num_splits = splits_for(context_len, grid_splits, MIN_TOKENS)
    # A split past what its sequence uses (a short sequence's work is in fewer programs) has an
    # empty slice: it reads nothing, and does nothing after the wait.
    works = split < num_splits
    tokens_per_split = (context_len + num_splits - 1) // num_splits
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)
    if NEW_TOKEN:
        slot = tl.load(slot_mapping_ptr + seq, mask=works, other=-1).to(tl.int64)
        holds_new_token = ((start < end) & (end == context_len) & (slot >= 0)).to(tl.int32)  # the last key
        cache_end = end - holds_new_token  # keys this program reads from the cache
    else:
        cache_end = end
    table_row = block_tables_ptr + seq * stride_bt
    if FIRST_N > 0:
        offs_n, mask_n, k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table_row, kv_head, start, cache_end,
                                            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                            BLOCK_SIZE, HEAD_DIM, FIRST_N, BLOCK_D)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    if NEW_TOKEN:
        # The rotary table's row for the new token's position (eager torch casts the float32
        # table to the activation dtype before multiplying).
        HALF: tl.constexpr = HEAD_DIM // 2
        partner_d = (offs_d + HALF) % HEAD_DIM
        table = cos_sin_ptr + tl.load(positions_ptr + seq, mask=works, other=0) * stride_cs
        d_ok = offs_d < tl.where(works, HEAD_DIM, 0)  # (a comparison: the interpreter takes no broadcast & as a mask)
        act = q_ptr.dtype.element_ty
        cos = tl.load(table + offs_d % HALF, mask=d_ok, other=0.0).to(act).to(tl.float32)[None, :]
        sin = tl.load(table + HALF + offs_d % HALF, mask=d_ok, other=0.0).to(act).to(tl.float32)
        sin_signed = tl.where(offs_d < HALF, -sin, sin)[None, :]
    if WAIT_AFTER_CACHE_READS:
        gdc_wait()  # q and the new K/V come from the kernel in front (every program waits: see the kernel)
    if works:
        mask_g = offs_g < GROUP
        heads = kv_head * GROUP + offs_g  # the query heads sharing this KV head; rows >= GROUP pad
        q_rows = q_ptr + seq * stride_qb + heads[:, None] * stride_qh
        if NEW_TOKEN:
            # q and the new key arrive as projected: normalise (Qwen3) and rotate them here.
            q = norm_rope_rows(q_rows, mask_g, offs_d, partner_d, q_norm_ptr, eps, cos, sin_signed,
                               HEAD_DIM, BLOCK_D, QK_NORM).to(DOT_DTYPE)
            one_row = tl.arange(0, 1) < holds_new_token  # [1]: the new token's row, if this program's
            new_mask = row_mask(one_row, offs_d, HEAD_DIM, BLOCK_D)
            k_new = norm_rope_rows(k_new_ptr + seq * stride_knt + kv_head * stride_knh + tl.zeros([1, 1], tl.int32),
                                   one_row, offs_d, partner_d, k_norm_ptr, eps, cos, sin_signed,
                                   HEAD_DIM, BLOCK_D, QK_NORM).to(k_cache_ptr.dtype.element_ty)
            v_new = tl.load(v_new_ptr + seq * stride_vnt + kv_head * stride_vnh + offs_d[None, :],
                            mask=new_mask, other=0.0).to(v_cache_ptr.dtype.element_ty)
        else:
            q = tl.load(q_rows + offs_d[None, :], mask=row_mask(mask_g, offs_d, HEAD_DIM, BLOCK_D),
                        other=0.0).to(DOT_DTYPE)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        if NEW_TOKEN:
            # Stored for the steps after this one (no program of this step reads it back).
            block, in_block = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            tl.store(k_cache_ptr + block * stride_kb + in_block * stride_kt + kv_head * stride_kh + offs_d[None, :],
                     k_new, mask=new_mask)
            tl.store(v_cache_ptr + block * stride_vb + in_block * stride_vt + kv_head * stride_vh + offs_d[None, :],
                     v_new, mask=new_mask)
        if FIRST_N > 0:
            if start < cache_end:  # (a split of the new token alone, or a padding row, reads no key)
                acc, m_i, l_i = fold_kv_tile(acc, m_i, l_i, q, k, v, mask_n, scale, DOT_DTYPE)
        last_visible = tl.zeros([BLOCK_G], tl.int32) + (cache_end - 1)  # every row sees the whole slice
        for tile_start in range(start + FIRST_N, cache_end, BLOCK_N):
            acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_row, kv_head, scale,
                                        tile_start, cache_end, last_visible,
                                        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                        BLOCK_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_DTYPE)
        if NEW_TOKEN:
            acc, m_i, l_i = fold_new_key(acc, m_i, l_i, q, k_new, v_new, holds_new_token != 0, scale, DOT_DTYPE)

        out_mask = row_mask(mask_g, offs_d, HEAD_DIM, BLOCK_D)
        out_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        # A context of 0 (a padding row) leaves acc = 0 and l = 0: its output is exact zeros.
        normalised = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if ONE_SPLIT:  # grid_splits == 1: the partials and the combine are compiled out
            tl.store(out_ptrs, normalised.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            if num_splits == 1:
                tl.store(out_ptrs, normalised.to(out_ptr.dtype.element_ty), mask=out_mask)
            else:
                # Partials: [batch, num_heads, grid_splits] (+ HEAD_DIM for acc), contiguous.
                part_row = (seq * num_heads + heads) * grid_splits + split
                tl.store(part_max_ptr + part_row, m_i, mask=mask_g)
                tl.store(part_sum_ptr + part_row, l_i, mask=mask_g)
                tl.store(part_acc_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
                if COMBINE_IN_LAST_SPLIT:
                    # Count this (sequence, KV head)'s finished splits; the program that finishes
                    # last combines them. The barrier puts all of this program's partial stores
                    # before its count; acq_rel publishes them with it and, in the last program,
                    # makes every other program's visible before it reads them.
                    tl.debug_barrier()
                    counter = splits_done_ptr + seq * num_kv_heads + kv_head
                    done_before = tl.atomic_add(counter, 1, sem="acq_rel")
                    if done_before == num_splits - 1:
                        tl.atomic_xchg(counter, 0)  # zero again for the next launch (graph replays too)
                        tl.debug_barrier()
                        combine_group(part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptrs, out_mask,
                                      (seq * num_heads + heads) * grid_splits, mask_g, offs_d, num_splits,
                                      HEAD_DIM, BLOCK_G, BLOCK_D)


@triton.jit
def decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_oh,
    stride_bt,
    num_heads, grid_splits,
    k_new_ptr, v_new_ptr, positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, slot_mapping_ptr, eps,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cs,
    splits_done_ptr,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    ONE_SPLIT: tl.constexpr, MIN_TOKENS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PDL: tl.constexpr, NEW_TOKEN: tl.constexpr, QK_NORM: tl.constexpr,
    COMBINE_IN_LAST_SPLIT: tl.constexpr, FIRST_N: tl.constexpr, EARLY_CACHE_READS: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
        # Every program waits, with work or without: a kernel's end must follow the one in
        # front's, since a later kernel's wait covers every kernel before it only through each
        # one's own.
        if not EARLY_CACHE_READS:  # q and the cache come from the kernels in front
            gdc_wait()
    decode_split_program(
        tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2),
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        scale,
        stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_ob, stride_oh, stride_bt,
        num_heads, tl.num_programs(1), grid_splits,
        k_new_ptr, v_new_ptr, positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, slot_mapping_ptr, eps,
        stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cs,
        splits_done_ptr,
        BLOCK_SIZE, GROUP, HEAD_DIM, ONE_SPLIT, MIN_TOKENS, BLOCK_G, BLOCK_N, BLOCK_D, DOT_DTYPE,
        NEW_TOKEN, QK_NORM, COMBINE_IN_LAST_SPLIT, FIRST_N, PDL and EARLY_CACHE_READS,
    )


@triton.jit
def combine_group(part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptrs, out_mask, first_rows, mask_g, offs_d,
                  num_splits, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """`decode_combine_kernel`'s arithmetic for a KV head's query heads at once (rows
    first_rows + s hold split s of each head), a split at a time: two passes over the partials,
    the first for the common max. Loads bypass L1 (.cg): other programs wrote the partials."""
    m_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        m_max = tl.maximum(m_max, tl.load(part_max_ptr + first_rows + s, mask=mask_g, other=0.0,
                                          cache_modifier=".cg"))
    denom = tl.zeros([BLOCK_G], tl.float32)
    total = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s in range(0, num_splits):
        rows = first_rows + s
        weight = tl.exp(tl.load(part_max_ptr + rows, mask=mask_g, other=0.0, cache_modifier=".cg") - m_max)
        denom += weight * tl.load(part_sum_ptr + rows, mask=mask_g, other=0.0, cache_modifier=".cg")
        acc = tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=out_mask, other=0.0,
                      cache_modifier=".cg")
        total += weight[:, None] * acc
    result = total / tl.where(denom > 0.0, denom, 1.0)[:, None]
    tl.store(out_ptrs, result.to(out_ptrs.dtype.element_ty), mask=out_mask)


@triton.jit
def combine_program(
    seq, head, part_acc_ptr, part_max_ptr, part_sum_ptr, context_len, out_ptr,
    stride_ob, stride_oh,
    num_heads, grid_splits,
    HEAD_DIM: tl.constexpr, MIN_TOKENS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The combine of (seq, head)'s partials (seq an int64, context_len its length); nothing for a
    sequence that used one split (the split program wrote its output itself)."""
    num_splits = splits_for(context_len, grid_splits, MIN_TOKENS)
    if num_splits > 1:
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        mask_s = offs_s < num_splits
        row = (seq * num_heads + head) * grid_splits + offs_s
        m = tl.load(part_max_ptr + row, mask=mask_s, other=float("-inf"))
        sums = tl.load(part_sum_ptr + row, mask=mask_s, other=0.0)
        acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=row_mask(mask_s, offs_d, HEAD_DIM, BLOCK_D), other=0.0)
        # More than one split means a context longer than MIN_TOKENS, and every split then holds
        # tokens, so m_max is finite; an empty split (max -inf) would still weigh exp(-inf) = 0.
        m_max = tl.max(m, axis=0)
        weight = tl.exp(m - m_max)
        denom = tl.sum(weight * sums, axis=0)
        result = tl.sum(weight[:, None] * acc, axis=0) / denom
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d,
                 result.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def decode_combine_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, context_lens_ptr, out_ptr,
    stride_ob, stride_oh,
    num_heads, grid_splits,
    HEAD_DIM: tl.constexpr, MIN_TOKENS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr, EARLY_CACHE_READS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    if PDL:  # the partials come from the split kernel
        gdc_launch_dependents()
        if not EARLY_CACHE_READS:
            gdc_wait()
    context_len = tl.load(context_lens_ptr + seq)  # uploaded before the step: it may come first
    if PDL and EARLY_CACHE_READS:
        gdc_wait()
    combine_program(seq, tl.program_id(1), part_acc_ptr, part_max_ptr, part_sum_ptr,
                    context_len, out_ptr, stride_ob, stride_oh, num_heads, grid_splits,
                    HEAD_DIM, MIN_TOKENS, BLOCK_S, BLOCK_D)
