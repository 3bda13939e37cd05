"""The CPU decode attention against per-sequence float64 attention, both ways the backend runs
it: the C++ kernel over the paged cache, and the torch path (exact K/V rows, two GEMMs) it takes
for shapes the kernel does not handle."""

from __future__ import annotations

import pytest
import torch

from fastgen.attention import AttentionMetadata
from fastgen.attention.torch_paged import TorchPagedBackend
from fastgen.compile import build_op_set


def reference_decode(q, keys_per_seq, values_per_seq, scale):
    """q: [B, H, D]; each sequence's own K/V [L_i, KV, D]; float64, plain softmax; an empty
    sequence (padding row) gives zeros."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, (k, v) in enumerate(zip(keys_per_seq, values_per_seq)):
        if len(k) == 0:
            continue
        group = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, 1)  # [L, H, D]
        v = v.double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[i].double(), k) * scale
        out[i] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v)
    return out


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request, monkeypatch):
    """Which way `TorchPagedBackend.decode` goes: the C++ kernel, or the torch gather and GEMMs."""
    if request.param == "torch":
        monkeypatch.setattr("fastgen.attention.torch_paged.kernel_supports", lambda *tensors: False)
    return request.param


def paged_batch(lengths, heads, kv_heads, dim, block_size, dtype):
    """Random K/V for sequences of `lengths`, scattered over shuffled blocks of a paged cache."""
    torch.manual_seed(0)
    width = max(1, -(-max(lengths) // block_size))
    num_blocks = len(lengths) * width + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)  # junk everywhere else
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    order = torch.randperm(num_blocks)
    tables = torch.full((len(lengths), width + 1), -1, dtype=torch.int32)  # wider than needed, as in the engine
    keys, values = [], []
    for i, n in enumerate(lengths):
        used = -(-n // block_size)
        tables[i, :used] = order[i * width : i * width + used].int()
        slots = tables[i, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
        keys.append(k_cache.view(-1, kv_heads, dim)[slots])
        values.append(v_cache.view(-1, kv_heads, dim)[slots])
    q = torch.randn(len(lengths), heads, dim).to(dtype)
    meta = AttentionMetadata(
        is_prefill=False, slot_mapping=torch.full((len(lengths),), -1), block_tables=tables,
        context_lens=torch.tensor(lengths, dtype=torch.int32), query_start_loc=None, max_query_len=1,
        max_context_len=max(lengths), logits_indices=None,
    )
    return q, k_cache, v_cache, meta, keys, values


@pytest.mark.parametrize("block_size", [1, 4, 16, 256])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (6, 1), (3, 3)], ids=["gqa", "mqa", "mha"])
def test_decode_over_ragged_lengths_equals_per_sequence_attention(block_size, heads, kv_heads, decode_path):
    lengths = [1, 37, 5, 16, 64]
    q, k_cache, v_cache, meta, keys, values = paged_batch(lengths, heads, kv_heads, 16, block_size, torch.float32)
    backend = TorchPagedBackend(build_op_set(False), block_size)
    out = backend.decode(q, k_cache, v_cache, backend.prepare(meta), 0.25)
    torch.testing.assert_close(out.double(), reference_decode(q, keys, values, 0.25), rtol=1e-5, atol=1e-5)


def test_decode_in_bfloat16_stays_close_to_float64(decode_path):
    q, k_cache, v_cache, meta, keys, values = paged_batch([9, 130, 77], 9, 3, 64, 16, torch.bfloat16)
    backend = TorchPagedBackend(build_op_set(False), 16)
    out = backend.decode(q, k_cache, v_cache, backend.prepare(meta), 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference_decode(q, keys, values, 0.125), rtol=2e-2, atol=2e-2)


def test_padding_rows_of_a_decode_batch_give_zeros_and_leave_real_rows_alone(decode_path):
    """A padded batch (context length 0 and an all -1 table) attends to nothing: its rows are
    0, not NaN, and the real rows equal the unpadded batch's."""
    q, k_cache, v_cache, meta, keys, values = paged_batch([7, 0, 20, 0], 4, 2, 16, 4, torch.float32)
    backend = TorchPagedBackend(build_op_set(False), 4)
    out = backend.decode(q, k_cache, v_cache, backend.prepare(meta), 0.25)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[3], torch.zeros_like(out[3]))
    torch.testing.assert_close(out.double(), reference_decode(q, keys, values, 0.25), rtol=1e-5, atol=1e-5)
