"""paged_prefill_attention (Triton) matches a float64 reference for chunks that follow a cached
history (prefix-cache hits, later chunks of a long prompt) and for fresh prompts, batched
together at different lengths."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastgen.kernels import paged_prefill_attention, paged_prefill_attention_torch  # noqa: E402

from tests.kernels.paged_cases import DEVICE, TOLERANCE, int32, paged_cache  # noqa: E402
from tests.pairwise import all_pairs_in_make_test  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = pytest.mark.triton


def make_case(histories, chunks, num_kv_heads, group, head_dim, block_size, dtype, seed=0):
    """One sequence per (history, chunk): `history` tokens already cached, `chunk` new ones
    (also already stored, as the layer stores before it attends). Returns the kernel's args."""
    gen = torch.Generator().manual_seed(seed)
    context_lens = [h + c for h, c in zip(histories, chunks)]
    max_blocks = max(-(-n // block_size) for n in context_lens) + 1
    k_cache, v_cache, tables = paged_cache(context_lens, num_kv_heads, head_dim, block_size, max_blocks, dtype, gen)
    q = torch.randn(sum(chunks), num_kv_heads * group, head_dim, generator=gen).to(dtype).to(DEVICE)
    starts = int32([0, *torch.tensor(chunks).cumsum(0).tolist()])
    return q, k_cache, v_cache, tables, starts, int32(context_lens), max(chunks), head_dim**-0.5


def assert_matches_reference(args) -> None:
    q, k_cache, v_cache, tables, starts, lens, max_q, scale = args
    out = paged_prefill_attention(*args)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any(), "a slot outside some context was read"
    want = paged_prefill_attention_torch(q.double(), k_cache.double(), v_cache.double(), tables, starts, lens,
                                         max_q, scale)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=TOLERANCE[q.dtype])


# Four sequences: a prefix-cache hit (history, then a chunk), a fresh prompt, a later chunk of a
# long prompt, and a fully cached prompt recomputing its last token.
HISTORIES = [37, 0, 130, 70]
CHUNKS = [21, 45, 70, 1]


@pytest.mark.parametrize("head_dim,group,block_size", all_pairs_in_make_test(
    {"64": (64,), "128": (128,)}, {str(g): (g,) for g in (1, 2, 4, 8)}, {str(b): (b,) for b in (1, 16, 256)}))
def test_chunks_after_cached_history_match_float64(block_size, group, head_dim):
    dtype = torch.bfloat16 if group % 2 == 0 else torch.float32
    assert_matches_reference(make_case(HISTORIES, CHUNKS, 2, group, head_dim, block_size, dtype,
                                       seed=block_size + group))


def test_fresh_prompts_without_history_are_plain_causal_attention():
    q, k_cache, v_cache, tables, starts, lens, max_q, scale = make_case([0, 0], [5, 80], 1, 4, 64, 16, torch.float32)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, max_q, scale)
    # The second prompt against SDPA's causal attention over its own (contiguous) K/V.
    blocks = tables[1, : -(-80 // 16)].long()
    keys = k_cache[blocks].flatten(0, 1)[:80].repeat_interleave(4, 1).transpose(0, 1)
    values = v_cache[blocks].flatten(0, 1)[:80].repeat_interleave(4, 1).transpose(0, 1)
    want = torch.nn.functional.scaled_dot_product_attention(q[5:].transpose(0, 1), keys, values, is_causal=True)
    torch.testing.assert_close(out[5:], want.transpose(0, 1), rtol=1e-4, atol=1e-4)


def test_odd_head_dim_and_block_size():
    assert_matches_reference(make_case([9, 0, 4], [7, 12, 33], 2, 3, 48, 5, torch.float32))


def test_writes_into_given_out_buffer_and_only_its_rows():
    q, k_cache, v_cache, tables, starts, lens, max_q, scale = make_case([3], [9], 1, 2, 32, 4, torch.float32)
    out = torch.full_like(q, 7.0)
    assert paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, max_q, scale, out=out) is out
    assert not (out == 7.0).any()


def test_rejects_int64_offsets():
    q, k_cache, v_cache, tables, starts, lens, max_q, scale = make_case([3], [9], 1, 2, 32, 4, torch.float32)
    with pytest.raises(ValueError, match="int32"):
        paged_prefill_attention(q, k_cache, v_cache, tables, starts.long(), lens, max_q, scale)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_long_chunks_after_long_histories_on_cuda(group):
    # A 2K-token chunk after a 6K history next to short prompts: the shapes of a chunked 8K prompt.
    args = make_case([6144, 0, 300, 0], [2048, 700, 1, 64], 8, group, 128, 16, torch.bfloat16, seed=group)
    assert_matches_reference(args)
