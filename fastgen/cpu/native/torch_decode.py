"""CPU decode attention over each sequence's real tokens: two batched GEMMs, no block gather.

Since the C++ kernel (`fastgen.cpu.native.decode_attention`) took over decode, this is the path
for shapes the kernel has no instance for, and the kernel's fallback where it cannot be built.

SDPA over whole gathered blocks with a boolean mask cost about 1 ms a layer at batch 32 on two
cores (its flash kernel is built for long queries, not one token). Here the step first works out,
once for all layers, the cache slot of every token each sequence attends to (`DecodeKVIndex`);
each layer then gathers exactly those K/V rows and runs two `bmm`s.

The GEMMs read K and V as they lie in the cache, [tokens, kv_heads * head_dim], with no permute:
each query head is spread over the full kv_heads * head_dim width with zeros outside its own KV
head's slice, so q·K^T sums only its group's dims; P·V yields every KV head's output for every
query head and each head keeps its own slice. The kv_heads-fold extra multiply-adds are cheaper
on a CPU than the copies a transposed K would need.

Shapes follow the step's longest context L, read from the index's tensors (never from a host
integer), so the compiled CPU decode step (`fastgen.cpu.compiled_decode`) traces it once with
L symbolic. It is not meant to be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DecodeKVIndex:
    """The K/V rows a decode batch attends to, shared by every layer of one step.

    slots: int64 [B, L], the flat cache slot of token j of sequence i, where L is the step's
        longest context; positions past a sequence's length point at its first slot.
    bias: float32 [B, 1, L], 0 for a real token and -inf past the sequence's length (0 for a
        whole padding row, whose output is defined as 0 by `live`).
    live: float32 [B, 1, 1], 1 for a real sequence and 0 for a padding row.
    """

    slots: torch.Tensor
    bias: torch.Tensor
    live: torch.Tensor


def build_decode_kv_index(block_tables: torch.Tensor, context_lens: torch.Tensor, max_len: int,
                          block_size: int) -> DecodeKVIndex:
    """block_tables: int32 [B, W] (-1 padded); context_lens: int32 [B]; max_len >= every length.

    Worked out in numpy over the two tensors' memory (the torch backend's home is the CPU):
    about 17 us at batch 1, where the dozen small torch ops it takes cost about 0.15 ms a step.
    On CUDA, where the torch backend is only a fallback, this reads the tables back to the host
    and uploads the index each step."""
    max_len = max(max_len, 1)
    device = block_tables.device
    pos = np.arange(max_len)
    width = -(-max_len // block_size)
    tables = np.maximum(block_tables.cpu().numpy()[:, :width], 0).astype(np.int64)
    lens = context_lens.cpu().numpy().astype(np.int64)[:, None]
    real = pos[None, :] < lens  # [B, L]
    slots = tables[:, pos // block_size] * block_size + pos % block_size
    slots = np.where(real, slots, slots[:, :1])
    padding_row = lens == 0
    bias = np.where(real | padding_row, np.float32(0), np.float32("-inf"))
    live = (~padding_row).astype(np.float32)
    arrays = (slots, bias.reshape(len(lens), 1, max_len), live.reshape(len(lens), 1, 1))  # contiguous, as traced
    return DecodeKVIndex(*(torch.from_numpy(a).to(device) for a in arrays))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: DecodeKVIndex,
                     scale: float) -> torch.Tensor:
    """q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KV, D]. Returns [B, H, D] in q's
    dtype. Scores and softmax are float32; the GEMMs run in the cache dtype."""
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    width = kv_heads * head_dim
    length = index.slots.shape[1]
    slots = index.slots.flatten()
    keys = k_cache.view(-1, width).index_select(0, slots).view(batch, length, width)
    values = v_cache.view(-1, width).index_select(0, slots).view(batch, length, width)
    # Head h of group g sits at columns [g * D, (g + 1) * D) of a zero row of `width`.
    spread = q.new_zeros(batch, kv_heads, group, kv_heads, head_dim)
    spread.diagonal(dim1=1, dim2=3).copy_(q.view(batch, kv_heads, group, head_dim).permute(0, 2, 3, 1))
    scores = torch.bmm(spread.view(batch, heads, width), keys.transpose(1, 2)).float()
    probs = torch.softmax(scores.mul_(scale).add_(index.bias), dim=-1).to(values.dtype)
    every = torch.bmm(probs, values).view(batch, kv_heads, group, kv_heads, head_dim)
    out = every.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(batch, heads, head_dim)
    return (out * index.live).to(q.dtype)

