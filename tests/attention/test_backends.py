"""Backend choice at start-up, and the torch paged backend against plain causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fastgen.kernels import store_kvcache_torch

from fastgen.attention import AttentionMetadata, backend, select_backend
from fastgen.attention.torch_paged import TorchPagedBackend
from fastgen.compile import build_op_set

EAGER = build_op_set(False)


def test_cpu_gets_torch_backend():
    assert select_backend(torch.device("cpu"), 3, EAGER).name == "torch"


def test_cuda_gets_triton_backend_without_flash_attn(monkeypatch):
    monkeypatch.setattr(backend, "flash_attn_available", lambda: False)
    assert select_backend(torch.device("cuda", 0), 16, EAGER).name == "triton"
    assert select_backend(torch.device("cpu"), 16, EAGER, name="triton").name == "triton"


def test_flash_attn_requires_block_size_multiple_of_256(monkeypatch):
    monkeypatch.setattr(backend, "flash_attn_available", lambda: True)
    with pytest.raises(ValueError, match=r"block_size=16 must be a multiple of 256 when flash-attn is installed"):
        select_backend(torch.device("cuda", 0), 16, EAGER)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_with_cached_history_equals_full_causal_attention(block_size):
    """A prompt whose first tokens are already in the cache attends exactly as if the whole
    prompt were computed at once."""
    torch.manual_seed(0)
    heads, kv_heads, dim, total, cached = 4, 2, 16, 23, 13
    q = torch.randn(total, heads, dim)
    k = torch.randn(total, kv_heads, dim)
    v = torch.randn(total, kv_heads, dim)
    num_blocks = 32
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    table = torch.randperm(num_blocks)[: -(-total // block_size)].int()
    slots = (table.long()[torch.arange(total) // block_size] * block_size + torch.arange(total) % block_size)
    be = TorchPagedBackend(EAGER, block_size)
    store_kvcache_torch(k[:cached], v[:cached], k_cache, v_cache, slots[:cached])  # an earlier step
    store_kvcache_torch(k[cached:], v[cached:], k_cache, v_cache, slots[cached:])
    new = total - cached
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=slots[cached:], block_tables=table.unsqueeze(0),
        context_lens=torch.tensor([total], dtype=torch.int32), query_start_loc=torch.tensor([0, new], dtype=torch.int32),
        max_query_len=new, max_context_len=total, logits_indices=torch.tensor([new - 1]),
    )
    out = be.prefill(q[cached:], k[cached:], v[cached:], k_cache, v_cache, be.prepare(meta), dim**-0.5)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)[cached:]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
