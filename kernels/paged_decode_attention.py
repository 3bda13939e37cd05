"""Decode attention over the paged KV cache, split along the context (flash-decoding).

One new query token per sequence attends to the `context_len` tokens already in the cache
(its own K/V included). The kernels are in `paged_decode_kernels`; how many splits a launch
has and each sequence uses is `decode_split_policy`. Every launch and scratch shape depends
on tensor shapes only, never on `context_lens` values, so the call can be captured in a CUDA
graph; a sequence with context_len 0 comes out as exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .attention_tile import paged_strides
from . import decode_split_policy
from .decode_split_policy import MAX_SPLITS, grid_splits, num_sms
from .paged_decode_kernels import decode_combine_kernel, decode_split_kernel
from .programmatic_launch import launch_options, programmatic_launch
from .qk_norm_rope_store import check_qk_norm_rope_args
from .triton_types import dot_dtype


# With more than one split, combine the partials in the split kernel's last program of each
# (sequence, KV head) instead of a second launch (`paged_decode_kernels`). Off until measured
# on a GPU against the combine launch (`benchmarks/gpu_decode.py --combine-in-split`).
COMBINE_IN_LAST_SPLIT = False

# A programmatic dependent preparing the new token reads its first keys and values, the block
# table and the new token's position before it waits for q|k|v, so that those round trips overlap
# the kernel in front instead of following it (`decode_split_program`). A launch that is not a
# programmatic dependent has no wait to read ahead of, and keeps its order unless asked
# (`paged_decode_attention(..., early_cache_reads=True)`, as the interpreter tests do).
EARLY_CACHE_READS = True
# Batches of at most this many rows read early (None: every batch). The batch is the launch's,
# which under CUDA graphs is the captured size a batch is padded to: a limit between capture
# sizes acts as the size below it. Only a batch can decide, not the tokens read, since a graph is
# captured for shapes. On an H200 (Qwen3-0.6B, bf16, `benchmarks/gpu_decode.py
# --early-cache-reads`) the step shrank by a fifth at batch 1 and a seventh at batch 2, where
# attention is a chain of round trips; 3 to 6 sequences (graphs of 4 and 8 rows) gained 2-3% at
# 512 tokens, while 4 at 4,096 tokens lost 15%, and 8 and 16 at 512 lost 4-8%: a guess, not
# measured apart, is that the reads ahead of the wait then compete with q|k|v's weights for the
# memory (docs/performance-gpu.md, "Decode attention's chain of round trips").
EARLY_CACHE_READS_MAX_BATCH: int | None = 2
# The most keys a split program asks for before q when reading early: a whole split at the
# default split length, so that nothing of the cache is left to read after the wait.
EARLY_TILE_MAX = 128

# Per device: the split kernel's counters of finished splits, zero between launches (the last
# program of each group zeroes its own), so one buffer serves every layer, step and graph replay
# on that device, as long as its launches run one after another (one stream).
_splits_done: dict[torch.device, torch.Tensor] = {}
# Counters a larger buffer replaced: kept, since graphs captured over them still use them.
_outgrown: list[torch.Tensor] = []


def splits_done_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` int32 counters at zero. Grown by a new buffer (never inside a CUDA-graph
    capture: the eager warm-up of every graph size runs first), the old one kept alive."""
    counters = _splits_done.get(device)
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the decode split counters must be allocated before CUDA-graph capture")
        if counters is not None:
            _outgrown.append(counters)
        counters = _splits_done[device] = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
    return counters


@dataclass(frozen=True)
class NewToken:
    """The step's new token as projected, for `paged_decode_attention` to prepare and store
    before it attends (what `qk_norm_rope_store` does in a launch of its own): k, v
    `[batch, num_kv_heads, head_dim]`; positions `[batch]` int64; cos_sin float32
    `[max_positions, head_dim]` (cos | sin); q/k RMSNorm weights `[head_dim]` (Qwen3) or None,
    and their eps; slot_mapping `[batch]` (-1 stores nothing)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    q_norm_weight: torch.Tensor | None
    k_norm_weight: torch.Tensor | None
    eps: float
    slot_mapping: torch.Tensor


def check_decode_args(q, k_cache, v_cache, block_tables, context_lens, out) -> None:
    """Validate shapes, dtypes and layouts at the boundary (cheap: no device sync)."""
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
    # The kernels address the head dim with unit stride.
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride along head_dim, got strides {t.stride()}")
    if block_tables.stride(1) != 1 or context_lens.stride(0) != 1:
        raise ValueError("block_tables rows and context_lens must be contiguous")


def split_tiles(group: int, head_dim: int, cache_dtype: torch.dtype) -> tuple[int, int, int, object]:
    """The split kernel's tile constants (BLOCK_G, BLOCK_N, BLOCK_D, DOT_DTYPE) for a GQA group
    and head dim over a cache of `cache_dtype`."""
    # tl.dot needs at least 16 rows and an inner dimension of at least 16.
    block_g = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    # fp32 (tests) multiplies on CUDA cores, not tensor cores: smaller tiles keep it in registers.
    block_n = 16 if cache_dtype.itemsize >= 4 else 64
    return block_g, block_n, block_d, dot_dtype(cache_dtype)


def first_tile_keys(block_n: int, min_tokens: int, cache_dtype: torch.dtype) -> int:
    """Keys in a split program's first tile when it reads early: a whole split of `min_tokens`
    (a power of two, at least `block_n`, at most `EARLY_TILE_MAX`); fp32 caches (tests) keep
    `block_n`, whose tiles are sized to stay in registers."""
    if cache_dtype.itemsize >= 4:
        return block_n
    return max(block_n, min(triton.next_power_of_2(min_tokens), EARLY_TILE_MAX))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_splits: int | None = None,
    out: torch.Tensor | None = None,
    new_token: NewToken | None = None,
    early_cache_reads: bool | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged context (Triton).

    Args:
        q: `[batch, num_heads, head_dim]`, float dtype, unit stride along head_dim (any
            head_dim; padded in-kernel).
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`; any block_size.
            `num_heads` must be a multiple of `num_kv_heads`; query head h reads KV head
            `h // (num_heads // num_kv_heads)`.
        block_tables: `[batch, max_blocks_per_seq]` int32, padded with -1.
        context_lens: `[batch]` int32, tokens to attend to, including the current one (whose
            K/V must already be stored). 0 marks a padding row: its output is zeros and no KV
            or block-table entry is read for it.
        scale: softmax scale, usually `head_dim ** -0.5`.
        max_splits: the launch's split count (an upper bound: each sequence uses
            `splits_for_lengths` of them); default `grid_splits` from the shapes.
        out: optional `[batch, num_heads, head_dim]` output buffer (e.g. a CUDA-graph buffer).
        new_token: with it, q is the projection as it comes (not yet normalised or rotated) and
            the cache does not hold the new token yet: the kernel prepares q and the new key as
            `qk_norm_rope_store` would and stores the new K/V (q is not rewritten).
        early_cache_reads: with `new_token` and a split grid (combined in its own launch), each
            split program reads its first keys and values (and the block table, its slot and
            position) before q, and before waiting for the kernel in front when it is a
            programmatic dependent. None: `EARLY_CACHE_READS` for batches of at most
            `EARLY_CACHE_READS_MAX_BATCH`, where the launch is one (where there is a wait to read
            ahead of).

    Returns:
        `out` (allocated in q's dtype when not given), `[batch, num_heads, head_dim]`.
    """
    check_decode_args(q, k_cache, v_cache, block_tables, context_lens, out)
    if new_token is not None:
        t = new_token
        check_qk_norm_rope_args(q, t.k, t.v, t.positions, t.cos_sin, t.q_norm_weight, t.k_norm_weight, k_cache,
                                v_cache, t.slot_mapping)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if max_splits is None:
        max_splits = grid_splits(batch, num_kv_heads, block_tables.shape[1] * block_size, num_sms(q.device))
    if not 1 <= max_splits <= MAX_SPLITS:
        raise ValueError(f"max_splits must be in [1, {MAX_SPLITS}], got {max_splits}")

    group = num_heads // num_kv_heads
    min_tokens = decode_split_policy.MIN_TOKENS_PER_SPLIT  # one value for both launches
    pdl = programmatic_launch(q.device)
    block_g, block_n, block_d, dot = split_tiles(group, head_dim, k_cache.dtype)
    if early_cache_reads is None:
        early_cache_reads = EARLY_CACHE_READS and pdl and (
            EARLY_CACHE_READS_MAX_BATCH is None or batch <= EARLY_CACHE_READS_MAX_BATCH)
    combine_in_split = max_splits > 1 and COMBINE_IN_LAST_SPLIT
    # Only where the context is split (batches of a few sequences, the chain-bound ones): a larger
    # batch keeps the kernel that takes fewer registers, for more programs an SM. Not with the
    # combine in the split kernel (off, measured slower): the two were never compiled together.
    early = early_cache_reads and new_token is not None and max_splits > 1 and not combine_in_split
    first_n = first_tile_keys(block_n, min_tokens, k_cache.dtype) if early else 0
    if max_splits > 1:
        part_acc = torch.empty((batch, num_heads, max_splits, head_dim), dtype=torch.float32, device=q.device)
        part_max = torch.empty((batch, num_heads, max_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:  # never touched: the one-split path is compiled without the partial stores
        part_acc = part_max = part_sum = out
    splits_done = splits_done_counters(q.device, batch * num_kv_heads) if combine_in_split else context_lens

    decode_split_kernel[(batch, num_kv_heads, max_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        out, part_acc, part_max, part_sum,
        scale,
        *paged_strides(q, k_cache, v_cache, out, block_tables),
        num_heads, max_splits,
        *_new_token_args(new_token, q),
        splits_done,
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim,
        ONE_SPLIT=max_splits == 1, MIN_TOKENS=min_tokens,
        BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, DOT_DTYPE=dot, PDL=pdl,
        NEW_TOKEN=new_token is not None, QK_NORM=new_token is not None and new_token.q_norm_weight is not None,
        COMBINE_IN_LAST_SPLIT=combine_in_split, FIRST_N=first_n, EARLY_CACHE_READS=early,
        # An early tile of 128 keys and values in registers across the wait spills at 4 warps (sm_90).
        num_warps=8 if early else 4, **launch_options(pdl),
    )
    if max_splits > 1 and not combine_in_split:
        decode_combine_kernel[(batch, num_heads)](
            part_acc, part_max, part_sum, context_lens, out,
            out.stride(0), out.stride(1),
            num_heads, max_splits,
            HEAD_DIM=head_dim, MIN_TOKENS=min_tokens, BLOCK_S=triton.next_power_of_2(MAX_SPLITS),
            BLOCK_D=block_d, PDL=pdl, EARLY_CACHE_READS=early,
            num_warps=4, **launch_options(pdl),
        )
    return out


def _new_token_args(t: NewToken | None, q: torch.Tensor) -> tuple:
    """The kernel's new-token arguments (pointers, eps, strides); q stands in for every pointer
    the kernel does not read."""
    if t is None:
        return (q, q, q, q, q, q, q, 0.0, 0, 0, 0, 0, 0)
    return (t.k, t.v, t.positions, t.cos_sin, q if t.q_norm_weight is None else t.q_norm_weight,
            q if t.k_norm_weight is None else t.k_norm_weight, t.slot_mapping, t.eps,
            t.k.stride(0), t.k.stride(1), t.v.stride(0), t.v.stride(1), t.cos_sin.stride(0))
