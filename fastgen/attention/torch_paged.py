"""Plain-torch paged attention: the CPU path."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from fastgen.attention.backend import rope_store_then_decode
from fastgen.attention.metadata import AttentionMetadata
from fastgen.cpu.native.decode_attention import kernel_built, kernel_supports, paged_decode_attention_cpu
from fastgen.cpu.native.torch_decode import DecodeKVIndex, build_decode_kv_index, decode_attention
from fastgen.kernels import store_kvcache_torch

if TYPE_CHECKING:
    from fastgen.compile import OpSet


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence's K or V: [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.flatten(0, 1)[:length]


@dataclasses.dataclass(frozen=True)
class CausalRows:
    """A prefill step's new tokens as rows of decode attention, shared by every layer of the step.

    Causal attention over a paged cache is, for the token at position p of a sequence, decode
    attention over that sequence's first p + 1 cached tokens. So once this step's K/V are
    stored, the decode kernel runs a whole prefill (every prompt, chunk or prefix-cached
    remainder) in one call, reading K/V in place.

    block_tables: int32 [T, W], the block table of each token's sequence.
    context_lens: int32 [T], each token's position + 1 (the tokens it sees).
    """

    block_tables: torch.Tensor
    context_lens: torch.Tensor


@dataclasses.dataclass(frozen=True)
class TorchStepPlan:
    """What the torch backend works out once a step for every layer (`prepare`), carried in
    `AttentionMetadata.backend_plan`; no other code reads it.

    decode_kv: a decode step's K/V rows per sequence (`DecodeKVIndex`), which also says whether
        the step's graph fuses attention into its own loops.
    causal_rows: a prefill step run by the C++ kernel (None: the per-sequence loop).
    every_slot_valid: no slot is -1, so the KV store needs no filter. The compiled CPU steps say
        so (`fastgen.cpu.compiled_decode`): they run only such steps, and a graph cannot hold
        the filter's data-dependent shape.
    """

    decode_kv: DecodeKVIndex | None = None
    causal_rows: CausalRows | None = None
    every_slot_valid: bool = False


def plan_of(meta: AttentionMetadata) -> TorchStepPlan:
    plan = meta.backend_plan
    assert isinstance(plan, TorchStepPlan), "the step's metadata must pass through TorchPagedBackend.prepare()"
    return plan


def host_lengths(meta: AttentionMetadata) -> tuple[np.ndarray, np.ndarray]:
    """A prefill step's new and total tokens per sequence, as host arrays (on a CPU a copy of a
    few ints; elsewhere a sync, which only the eager per-sequence loop pays)."""
    starts = meta.query_start_loc.cpu().numpy().astype(np.int64)
    return starts[1:] - starts[:-1], meta.context_lens.cpu().numpy().astype(np.int64)


def build_causal_rows(meta: AttentionMetadata) -> CausalRows:
    """The rows of a prefill step, worked out on the host from its query and context lengths."""
    query_lens, context_lens = host_lengths(meta)
    history = context_lens - query_lens  # tokens cached before
    seq_of_row = np.repeat(np.arange(len(query_lens)), query_lens)
    first_row = np.cumsum(query_lens) - query_lens
    position = history[seq_of_row] + np.arange(len(seq_of_row)) - first_row[seq_of_row]
    device = meta.block_tables.device
    tables = meta.block_tables.index_select(0, torch.from_numpy(seq_of_row).to(device))
    return CausalRows(tables, torch.from_numpy((position + 1).astype(np.int32)).to(device))


class TorchPagedBackend:
    """ops: the (possibly compiled) element-wise op set the q/k preparation runs on;
    block_size: the cache's, which the decode index needs."""

    name = "torch"

    def __init__(self, ops: OpSet, block_size: int):
        self.ops = ops
        self.block_size = block_size

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        if meta.is_prefill:
            # Without the kernel's library (or off a CPU) prefill takes the per-sequence loop.
            use_kernel = meta.block_tables.device.type == "cpu" and kernel_built()
            return dataclasses.replace(meta, backend_plan=TorchStepPlan(
                causal_rows=build_causal_rows(meta) if use_kernel else None))
        index = build_decode_kv_index(meta.block_tables, meta.context_lens, meta.max_context_len, self.block_size)
        return dataclasses.replace(meta, backend_plan=TorchStepPlan(decode_kv=index))

    def rope_and_store(self, positions, q, k, v, cos_sin, q_norm_weight, k_norm_weight, norm_eps,
                       k_cache, v_cache, meta: AttentionMetadata):
        if q_norm_weight is not None:
            q = self.ops.rms_norm(q, q_norm_weight, norm_eps)
            k = self.ops.rms_norm(k, k_norm_weight, norm_eps)
        q, k = self.ops.apply_rope(positions, q, k, cos_sin)
        self.store(k, v, k_cache, v_cache, meta)
        return q, k

    def rope_store_and_decode(self, *args, **kwargs) -> torch.Tensor:
        return rope_store_then_decode(self, *args, **kwargs)

    def store(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        # Metadata no prepare() saw (a store outside a step) gets the filter, which is always right.
        plan = meta.backend_plan
        every_slot_valid = isinstance(plan, TorchStepPlan) and plan.every_slot_valid
        store_kvcache_torch(k, v, k_cache, v_cache, meta.slot_mapping, skip_invalid=not every_slot_valid)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        rows = plan_of(meta).causal_rows
        if rows is not None and kernel_supports(q, k_cache, v_cache):
            return paged_decode_attention_cpu(q, k_cache, v_cache, rows.block_tables, rows.context_lens, scale)
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(*(lens.tolist() for lens in host_lengths(meta)))):
            end = start + q_len
            if ctx_len == q_len:  # no cached history: attend to the fresh K/V directly
                keys, values, mask = k[start:end], v[start:end], None
            else:
                table = meta.block_tables[i]
                keys = gather_kv(k_cache, table, ctx_len)
                values = gather_kv(v_cache, table, ctx_len)
                # Query j sits at position ctx_len - q_len + j and sees keys up to there.
                rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (ctx_len - q_len)
                mask = torch.arange(ctx_len, device=q.device).unsqueeze(0) <= rows
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[start:end] = o.squeeze(0).transpose(0, 1)
            start = end
        return out

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        index = plan_of(meta).decode_kv
        assert index is not None, "a decode step's plan holds its K/V index"
        if kernel_supports(q, k_cache, v_cache):
            return paged_decode_attention_cpu(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        return decode_attention(q, k_cache, v_cache, index, scale)
