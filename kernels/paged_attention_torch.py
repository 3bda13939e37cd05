"""Plain-torch twins of the paged attention kernels (same contracts), for CPU and as test
oracles: they loop over the batch and read `context_lens` on the host, so they are not
graph-capturable. They compute in at least fp32; float64 inputs stay float64."""

from __future__ import annotations

import torch

from .paged_decode_attention import check_decode_args


def _gather(cache: torch.Tensor, table_row: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `length` tokens of one sequence: [length, num_kv_heads, head_dim] in `dtype`."""
    block_size = cache.shape[1]
    blocks = table_row[: -(-length // block_size)].long()
    return cache[blocks].flatten(0, 1)[:length].to(dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, first_position: int) -> torch.Tensor:
    """q [n, H, D] at positions first_position.., k/v [ctx, KV, D]: causal attention [n, H, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    positions = torch.arange(q.shape[0], device=q.device) + first_position
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= positions[:, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale, max_splits=None, out=None):
    """Twin of `paged_decode_attention` (`max_splits` accepted for signature parity, ignored)."""
    del max_splits
    check_decode_args(q, k_cache, v_cache, block_tables, context_lens, out)
    compute = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q) if out is None else out
    for seq, context_len in enumerate(context_lens.tolist()):
        if context_len == 0:
            out[seq].zero_()
            continue
        k = _gather(k_cache, block_tables[seq], context_len, compute)
        v = _gather(v_cache, block_tables[seq], context_len, compute)
        out[seq] = _attend(q[seq : seq + 1].to(compute), k, v, scale, context_len - 1)[0].to(out.dtype)
    return out


def paged_prefill_attention_torch(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, max_query_len,
                                  scale, out=None):
    """Twin of `paged_prefill_attention` (`max_query_len` accepted for signature parity)."""
    del max_query_len
    compute = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q) if out is None else out
    starts = query_start_loc.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        if end == start:
            continue
        k = _gather(k_cache, block_tables[seq], context_len, compute)
        v = _gather(v_cache, block_tables[seq], context_len, compute)
        history = context_len - (end - start)
        out[start:end] = _attend(q[start:end].to(compute), k, v, scale, history).to(out.dtype)
    return out
