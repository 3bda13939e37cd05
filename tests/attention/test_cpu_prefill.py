"""CPU prefill through the decode kernel: every new token is a decode row over its sequence's
first position + 1 cached tokens (`build_causal_rows`). Checked against float64 causal attention
per sequence, for fresh prompts and prompts whose first tokens an earlier step (or the prefix
cache) already stored, and against the per-sequence SDPA loop the backend otherwise runs."""

from __future__ import annotations

import pytest
import torch
from fastgen.kernels import store_kvcache_torch

from fastgen.attention import AttentionMetadata
from fastgen.attention.torch_paged import TorchPagedBackend, build_causal_rows
from fastgen.compile import build_op_set
from fastgen.cpu.native import decode_attention as cpu_decode_kernel


def reference_prefill(q, k, v, history, scale):
    """One sequence: q [new, H, D] at positions history.., k/v [history + new, KV, D]; float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    positions = torch.arange(q.shape[0]).unsqueeze(1) + history
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > positions, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def prefill_step(seqs, heads, kv_heads, dim, block_size, dtype):
    """seqs: (tokens cached before, new tokens) per sequence. Stores every token's K/V in shuffled
    blocks of a cache full of junk, and returns the step's q/k/v of the new tokens, the caches,
    the metadata as the engine fills it, and each sequence's full K/V."""
    torch.manual_seed(0)
    width = max(-(-(h + n) // block_size) for h, n in seqs)
    num_blocks = len(seqs) * width + 2
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    order = torch.randperm(num_blocks)
    tables = torch.full((len(seqs), width + 1), -1, dtype=torch.int32)
    qs, ks, vs, step_slots, full = [], [], [], [], []
    for i, (history, new) in enumerate(seqs):
        total = history + new
        used = -(-total // block_size)
        tables[i, :used] = order[i * width : i * width + used].int()
        slots = tables[i, torch.arange(total) // block_size].long() * block_size + torch.arange(total) % block_size
        k, v = torch.randn(total, kv_heads, dim).to(dtype), torch.randn(total, kv_heads, dim).to(dtype)
        store_kvcache_torch(k[:history], v[:history], k_cache, v_cache, slots[:history])  # an earlier step
        qs.append(torch.randn(new, heads, dim).to(dtype))
        ks.append(k[history:])
        vs.append(v[history:])
        step_slots.append(slots[history:])
        full.append((k, v, history))
    new_lens = [n for _, n in seqs]
    starts = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=torch.cat(step_slots), block_tables=tables,
        context_lens=torch.tensor([h + n for h, n in seqs], dtype=torch.int32), query_start_loc=starts,
        max_query_len=max(new_lens), max_context_len=max(h + n for h, n in seqs),
        logits_indices=starts[1:].long() - 1,
    )
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, full


def run_prefill(backend, q, k, v, k_cache, v_cache, meta, scale):
    """What the attention layer does in a prefill step: store the new K/V, then attend."""
    prepared = backend.prepare(meta)
    backend.store(k, v, k_cache, v_cache, prepared)
    return backend.prefill(q, k, v, k_cache, v_cache, prepared, scale)


SEQS = [(0, 1), (0, 37), (13, 10), (16, 1), (5, 64), (0, 16)]


def test_causal_rows_give_each_token_its_table_and_position():
    _, _, _, _, _, meta, _ = prefill_step([(0, 3), (5, 2)], 2, 1, 16, 4, torch.float32)
    rows = build_causal_rows(meta)
    assert rows.context_lens.tolist() == [1, 2, 3, 6, 7]
    assert torch.equal(rows.block_tables, meta.block_tables[[0, 0, 0, 1, 1]])
    assert rows.context_lens.dtype == rows.block_tables.dtype == torch.int32


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (6, 1), (3, 3)], ids=["gqa", "mqa", "mha"])
def test_prefill_through_the_kernel_equals_causal_attention_per_sequence(block_size, heads, kv_heads):
    q, k, v, k_cache, v_cache, meta, full = prefill_step(SEQS, heads, kv_heads, 16, block_size, torch.float32)
    backend = TorchPagedBackend(build_op_set(False), block_size)
    assert backend.prepare(meta).backend_plan.causal_rows is not None  # the kernel's way
    out = run_prefill(backend, q, k, v, k_cache, v_cache, meta, 0.25)
    assert_each_sequence_equals_reference(out, q, full, SEQS, 0.25)


def test_bfloat16_prefill_through_the_kernel_matches_the_sdpa_loop(monkeypatch):
    """SmolLM2's shapes in bf16: the kernel and the per-sequence SDPA loop (which transformers'
    attention also runs) agree to within bf16 rounding of the output."""
    q, k, v, k_cache, v_cache, meta, full = prefill_step([(0, 90), (40, 33), (0, 7)], 9, 3, 64, 16, torch.bfloat16)
    backend = TorchPagedBackend(build_op_set(False), 16)
    kernel = run_prefill(backend, q, k, v, k_cache, v_cache, meta, 0.125)
    monkeypatch.setattr("fastgen.attention.torch_paged.kernel_supports", lambda *tensors: False)
    loop = run_prefill(backend, q, k, v, k_cache, v_cache, meta, 0.125)
    assert kernel.dtype == torch.bfloat16
    torch.testing.assert_close(kernel.float(), loop.float(), rtol=1.6e-2, atol=1e-2)


def assert_each_sequence_equals_reference(out, q, full, seqs, scale):
    start = 0
    for (k_all, v_all, history), (_, new) in zip(full, seqs):
        want = reference_prefill(q[start : start + new], k_all, v_all, history, scale)
        torch.testing.assert_close(out[start : start + new].double(), want, rtol=1e-5, atol=1e-5)
        start += new


def test_prefill_with_a_head_dim_the_kernel_lacks_takes_the_sdpa_loop(monkeypatch):
    seqs = [(0, 9), (4, 5)]
    q, k, v, k_cache, v_cache, meta, full = prefill_step(seqs, 4, 2, 48, 4, torch.float32)
    kernel_calls = []
    monkeypatch.setattr("fastgen.attention.torch_paged.paged_decode_attention_cpu",
                        lambda *args: kernel_calls.append(args))
    out = run_prefill(TorchPagedBackend(build_op_set(False), 4), q, k, v, k_cache, v_cache, meta, 0.2)
    assert kernel_calls == []
    assert_each_sequence_equals_reference(out, q, full, seqs, 0.2)


def test_without_the_kernel_library_prefill_takes_the_sdpa_loop(monkeypatch):
    """The op's own fallback would gather every token's whole context (quadratic in the prompt):
    prefill never goes through it, it asks whether the library built."""
    monkeypatch.setattr(cpu_decode_kernel, "_entry_point", lambda: None)
    q, k, v, k_cache, v_cache, meta, full = prefill_step(SEQS, 4, 2, 16, 4, torch.float32)
    backend = TorchPagedBackend(build_op_set(False), 4)
    assert backend.prepare(meta).backend_plan.causal_rows is None
    assert_each_sequence_equals_reference(run_prefill(backend, q, k, v, k_cache, v_cache, meta, 0.25), q, full,
                                          SEQS, 0.25)
