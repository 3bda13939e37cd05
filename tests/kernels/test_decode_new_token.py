"""Decode attention that prepares the step's new token itself (`paged_decode_attention(...,
new_token=...)`: q/k RMSNorm, RoPE and the K/V store inside the split kernel) equals the two
launches it replaces, `qk_norm_rope_store` then `paged_decode_attention`."""

from __future__ import annotations

import importlib

import pytest
import torch

from fastgen.kernels import paged_decode_attention, qk_norm_rope_store
from fastgen.kernels.paged_decode_attention import NewToken
from fastgen.layers.rotary import RotaryEmbedding
from tests.kernels.paged_cases import DEVICE, int32, paged_cache, record_decode_launches
from tests.pairwise import all_pairs_in_make_test

pytestmark = pytest.mark.triton

HEADS, KV_HEADS, BLOCK = 4, 2, 16
EPS = 1e-6


def step(dtype, head_dim, context_lens, seed=0):
    """A cache holding each row's context but its last token (that slot is NaN: the kernel must
    take the new K/V from the projection, never from the cache), the new token's q|k|v as views
    of one projection, its positions and slots; a row of length 0 is graph padding (slot -1)."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = paged_cache(context_lens, KV_HEADS, head_dim, BLOCK, 24, dtype, gen)
    slots = []
    for row, n in enumerate(context_lens):
        if n == 0:
            slots.append(-1)
            continue
        block = int(tables[row, (n - 1) // BLOCK])
        slots.append(block * BLOCK + (n - 1) % BLOCK)
        for cache in (k_cache, v_cache):
            cache.view(-1, KV_HEADS, head_dim)[slots[-1]] = float("nan")
    batch = len(context_lens)
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = (t.view(batch, -1, head_dim) for t in qkv.split([HEADS * head_dim, KV_HEADS * head_dim,
                                                               KV_HEADS * head_dim], dim=-1))
    positions = torch.tensor([max(n - 1, 0) for n in context_lens], device=DEVICE)
    cos_sin = RotaryEmbedding(head_dim, 1024, 10000.0, None).cos_sin.to(DEVICE)
    weights = [(torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(DEVICE) for _ in range(2)]
    return q, k, v, k_cache, v_cache, tables, int32(context_lens), positions, cos_sin, weights, \
        torch.tensor(slots, device=DEVICE)


@pytest.mark.parametrize("dtype,head_dim,qk_norm,max_splits", all_pairs_in_make_test(
    {"fp32-d64": (torch.float32, 64), "bf16-d128": (torch.bfloat16, 128), "fp32-d80": (torch.float32, 80)},
    {"qk-norm": (True,), "rope-only": (False,)}, {"grid1": (1,), "grid3": (3,), "grid-auto": (None,)}))
def test_preparing_the_new_token_in_the_kernel_equals_the_separate_launch(dtype, head_dim, qk_norm, max_splits):
    """Rows of 1 token (only the new one), of one and of several splits, and a padding row."""
    q, k, v, k_cache, v_cache, tables, lens, positions, cos_sin, (qw, kw), slots = step(
        dtype, head_dim, [1, 40, 300, 0], seed=head_dim)
    norm = (qw, kw) if qk_norm else (None, None)
    scale = head_dim**-0.5
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = q.clone()
    qk_norm_rope_store(q_ref, k.clone(), v, positions, cos_sin, *norm, EPS, k_ref, v_ref, slots)
    want = paged_decode_attention(q_ref, k_ref, v_ref, tables, lens, scale, max_splits=max_splits)

    q_before = q.clone()
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, max_splits=max_splits,
                                 new_token=NewToken(k, v, positions, cos_sin, *norm, EPS, slots))
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tolerance)
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, **tolerance)
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    assert torch.equal(q, q_before)  # q is read as projected, not rewritten
    assert not got[-1].any()  # the padding row


# The combine in the last split is off by default (measured slower): test-slow takes the grid
# sized from the shapes.
@pytest.mark.parametrize("max_splits", [3, pytest.param(None, marks=pytest.mark.slow)], ids=["grid3", "grid-auto"])
def test_the_new_token_with_the_combine_in_the_last_split_equals_the_separate_launches(max_splits, monkeypatch):
    """Both fusions at once: the program holding the new token stores it, another may combine."""
    q, k, v, k_cache, v_cache, tables, lens, positions, cos_sin, (qw, kw), slots = step(
        torch.float32, 64, [1, 40, 300, 0, 380], seed=5)
    k_ref, v_ref, q_ref = k_cache.clone(), v_cache.clone(), q.clone()
    qk_norm_rope_store(q_ref, k.clone(), v, positions, cos_sin, qw, kw, EPS, k_ref, v_ref, slots)
    want = paged_decode_attention(q_ref, k_ref, v_ref, tables, lens, 0.125, max_splits=max_splits)
    monkeypatch.setattr(importlib.import_module("fastgen.kernels.paged_decode_attention"), "COMBINE_IN_LAST_SPLIT",
                        True)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, max_splits=max_splits,
                                 new_token=NewToken(k, v, positions, cos_sin, qw, kw, EPS, slots))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, rtol=1e-5, atol=1e-5)


def test_a_new_token_that_does_not_fit_the_queries_is_refused():
    q, k, v, k_cache, v_cache, tables, lens, positions, cos_sin, (qw, kw), slots = step(torch.float32, 64, [5, 9])
    with pytest.raises(ValueError, match="positions must be"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1,
                               new_token=NewToken(k, v, positions[:1], cos_sin, qw, kw, EPS, slots))
    with pytest.raises(ValueError, match="together or not at all"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1,
                               new_token=NewToken(k, v, positions, cos_sin, qw, None, EPS, slots))


@pytest.mark.parametrize("max_splits", [2, None], ids=["grid2", "grid-auto"])
@pytest.mark.parametrize("min_tokens", [64, 128])
def test_reading_the_cache_before_q_equals_the_separate_launches(min_tokens, max_splits, monkeypatch):
    """Early cache reads (`EARLY_CACHE_READS` on a GPU): a split's first keys (a whole split of
    `min_tokens`, 128 at most) are read before q, then the rest of a longer split (two splits
    of 150 keys: 128 then 22, or 64, 64 and 22) in the loop's tiles; the new token, the last
    key, never comes from the cache (its row there is NaN)."""
    monkeypatch.setattr(importlib.import_module("fastgen.kernels.decode_split_policy"), "MIN_TOKENS_PER_SPLIT",
                        min_tokens)
    q, k, v, k_cache, v_cache, tables, lens, positions, cos_sin, (qw, kw), slots = step(
        torch.bfloat16, 128, [1, 40, 300, 0, 130], seed=min_tokens)
    k_ref, v_ref, q_ref = k_cache.clone(), v_cache.clone(), q.clone()
    qk_norm_rope_store(q_ref, k.clone(), v, positions, cos_sin, qw, kw, EPS, k_ref, v_ref, slots)
    want = paged_decode_attention(q_ref, k_ref, v_ref, tables, lens, 128**-0.5, max_splits=max_splits)

    first_tiles = record_decode_launches(monkeypatch, "FIRST_N")
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, 128**-0.5, max_splits=max_splits,
                                 new_token=NewToken(k, v, positions, cos_sin, qw, kw, EPS, slots),
                                 early_cache_reads=True)  # (no programmatic launch under the interpreter)
    assert first_tiles == [min_tokens]  # the early path ran, with a whole split's keys up front
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert not got.isnan().any()  # no stale (NaN) row of the cache reached a sum
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, rtol=1e-2, atol=1e-2)
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    assert not got[3].any()  # the padding row


def test_only_small_batches_read_the_cache_early_by_default(monkeypatch):
    """By default (`early_cache_reads=None`) a programmatic dependent reads early at batches of
    at most `EARLY_CACHE_READS_MAX_BATCH` (2), where the GPU measured the step shorter, and at no
    batch when `EARLY_CACHE_READS` is off; a launch that is no programmatic dependent never does.
    The launches are recorded, not run: the interpreter has no programmatic launch."""
    launcher = importlib.import_module("fastgen.kernels.paged_decode_attention")
    seen = record_decode_launches(monkeypatch, "EARLY_CACHE_READS", ("decode_split_kernel", "decode_combine_kernel"),
                                 run=False)

    def early_by_batch(pdl: bool) -> list[bool]:
        monkeypatch.setattr(launcher, "programmatic_launch", lambda device: pdl)
        flags = []
        for batch in (1, 2, 3, 8):
            q, k, v, k_cache, v_cache, tables, lens, positions, cos_sin, (qw, kw), slots = step(
                torch.bfloat16, 128, [300] * batch, seed=batch)
            seen.clear()
            launcher.paged_decode_attention(q, k_cache, v_cache, tables, lens, 128**-0.5, max_splits=4,
                                            new_token=NewToken(k, v, positions, cos_sin, qw, kw, EPS, slots))
            assert len(seen) == 2 and seen[0] == seen[1]  # the split kernel and the combine agree
            flags.append(seen[0])
        return flags

    assert launcher.EARLY_CACHE_READS and launcher.EARLY_CACHE_READS_MAX_BATCH == 2
    assert early_by_batch(pdl=True) == [True, True, False, False]
    assert early_by_batch(pdl=False) == [False] * 4
    monkeypatch.setattr(launcher, "EARLY_CACHE_READS_MAX_BATCH", None)
    assert early_by_batch(pdl=True) == [True] * 4
    monkeypatch.setattr(launcher, "EARLY_CACHE_READS", False)
    assert early_by_batch(pdl=True) == [False] * 4
