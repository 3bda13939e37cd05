"""paged_decode_attention (Triton, split-KV) matches a float64 torch reference.

Every case builds a cache whose blocks are shuffled across the pool and whose every slot
outside the live contexts (unused blocks, the tail of each last block) holds NaN, so a kernel
that reads one wrong slot produces NaN instead of a small numeric error.
"""

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastgen.kernels import paged_decode_attention, paged_decode_attention_torch  # noqa: E402
from fastgen.kernels.paged_decode_attention import default_num_splits  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@dataclass
class PagedCase:
    q: torch.Tensor  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [batch, max_blocks_per_seq] int32, -1 padded
    context_lens: torch.Tensor  # [batch] int32

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5

    def reference(self) -> torch.Tensor:
        """The float64 oracle (the NaN slots are never in a context, so it never sees them)."""
        return paged_decode_attention_torch(
            self.q.double(), self.k_cache.double(), self.v_cache.double(),
            self.block_tables, self.context_lens, self.scale,
        )


def make_case(context_lens, num_kv_heads, group, head_dim, block_size, max_blocks, dtype, seed=0,
              spare_blocks=3):
    """Random q and cache for the given per-row context lengths, blocks shuffled over the pool."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    blocks_per_row = [-(-n // block_size) for n in context_lens]
    assert max(blocks_per_row) <= max_blocks
    num_blocks = sum(blocks_per_row) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    block_tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    for row, (n_tokens, n_blocks) in enumerate(zip(context_lens, blocks_per_row)):
        ids = [pool.pop() for _ in range(n_blocks)]
        block_tables[row, :n_blocks] = torch.tensor(ids, dtype=torch.int32)
        token_block = torch.tensor(ids, dtype=torch.long).repeat_interleave(block_size)[:n_tokens]
        token_offset = torch.arange(n_tokens) % block_size
        k_cache[token_block, token_offset] = torch.randn(n_tokens, num_kv_heads, head_dim, generator=gen)
        v_cache[token_block, token_offset] = torch.randn(n_tokens, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=gen)
    return PagedCase(
        q=q.to(dtype).to(DEVICE),
        k_cache=k_cache.to(dtype).to(DEVICE),
        v_cache=v_cache.to(dtype).to(DEVICE),
        block_tables=block_tables.to(DEVICE),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
    )


def assert_matches_reference(case: PagedCase, num_splits) -> None:
    out = paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                 case.context_lens, case.scale, num_splits=num_splits)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert not out.isnan().any(), "a slot outside some context was read"
    empty = case.context_lens == 0
    assert (out[empty] == 0).all(), "context_len 0 rows must be exact zeros"
    torch.testing.assert_close(out.double(), case.reference(), rtol=0, atol=TOLERANCE[case.q.dtype])


# (context_lens, num_kv_heads, group, head_dim, block_size, max_blocks, dtype)
SHAPES = {
    "b1-mha-d64-bs16-fp32": ([37], 2, 1, 64, 16, 4, torch.float32),
    "b3-gqa2-d128-bs16-fp32": ([0, 16, 50], 1, 2, 128, 16, 4, torch.float32),
    "b3-gqa4-d64-bs1-fp32": ([9, 0, 12], 1, 4, 64, 1, 12, torch.float32),
    "b3-gqa8-d128-bs256-bf16": ([300, 1, 0], 1, 8, 128, 256, 2, torch.bfloat16),
    "b8-gqa4-d64-bs16-bf16": ([0, 1, 15, 16, 17, 33, 48, 64], 1, 4, 64, 16, 4, torch.bfloat16),
    "b3-mha-d48-bs3-fp32": ([7, 0, 12], 2, 1, 48, 3, 4, torch.float32),
    "b1-gqa2-d64-bs256-bf16": ([257], 2, 2, 64, 256, 2, torch.bfloat16),
    "b3-gqa8-d48-bs1-fp32": ([5, 3, 0], 1, 8, 48, 1, 6, torch.float32),
    "b3-gqa3-d32-bs5-fp32": ([11, 0, 4], 2, 3, 32, 5, 3, torch.float32),
    "b3-gqa2-d16-bs16-fp16": ([0, 20, 31], 1, 2, 16, 16, 2, torch.float16),
}


@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["splits1", "splits3", "splits-auto"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_float64_reference(shape, num_splits):
    assert_matches_reference(make_case(*shape, seed=len(shape[0])), num_splits)


@pytest.mark.parametrize("num_splits", [5, 16], ids=["splits5", "splits16"])
def test_more_splits_than_blocks_leaves_empty_splits_neutral(num_splits):
    # Two blocks per row at most, so most splits of the short rows are empty.
    case = make_case([3, 0, 40], num_kv_heads=1, group=2, head_dim=64, block_size=32,
                     max_blocks=2, dtype=torch.float32)
    assert_matches_reference(case, num_splits)


def test_padding_row_with_all_minus_one_table_reads_no_kv():
    # Cache is NaN everywhere except row 1's tokens; row 0 and 2 are CUDA-graph padding.
    case = make_case([0, 20, 0], num_kv_heads=2, group=2, head_dim=64, block_size=16,
                     max_blocks=3, dtype=torch.float32, spare_blocks=0)
    assert (case.block_tables[[0, 2]] == -1).all()
    out = paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                 case.context_lens, case.scale, num_splits=2)
    assert (out[[0, 2]] == 0).all()
    torch.testing.assert_close(out.double(), case.reference(), rtol=0, atol=2e-3)


def test_writes_into_given_out_buffer():
    case = make_case([5, 0], num_kv_heads=1, group=1, head_dim=32, block_size=4,
                     max_blocks=2, dtype=torch.float32)
    out = torch.full_like(case.q, 7.0)
    result = paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                    case.context_lens, case.scale, out=out)
    assert result is out
    torch.testing.assert_close(out.double(), case.reference(), rtol=0, atol=2e-3)


def test_torch_twin_matches_float64_in_bf16():
    case = make_case([0, 7, 30], num_kv_heads=2, group=4, head_dim=64, block_size=8,
                     max_blocks=4, dtype=torch.bfloat16)
    out = paged_decode_attention_torch(case.q, case.k_cache, case.v_cache, case.block_tables,
                                       case.context_lens, case.scale)
    assert (out[0] == 0).all()
    torch.testing.assert_close(out.double(), case.reference(), rtol=0, atol=3e-2)


def test_default_num_splits_fills_the_gpu_within_the_context():
    cpu = torch.device("cpu")
    # One sequence, 8 KV heads, a long context: about 2 programs per SM (of 132).
    assert default_num_splits(1, 8, 32768, cpu) == 33
    # ... but never more splits than the combine kernel is built for.
    assert default_num_splits(1, 1, 32768, cpu) == 128
    # Short contexts are not cut below _MIN_TOKENS_PER_SPLIT tokens per split.
    assert default_num_splits(1, 1, 300, cpu) == 3
    # A big batch already fills the GPU.
    assert default_num_splits(256, 8, 4096, cpu) == 1
    assert default_num_splits(1, 1, 0, cpu) == 1


def test_rejects_heads_not_multiple_of_kv_heads():
    case = make_case([4], num_kv_heads=2, group=1, head_dim=16, block_size=4, max_blocks=1,
                     dtype=torch.float32)
    q = torch.zeros(1, 3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables,
                               case.context_lens, 1.0)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 2, 4, 8], ids=["mha", "gqa2", "gqa4", "gqa8"])
def test_large_shapes_on_cuda(group, dtype):
    gen = torch.Generator().manual_seed(group)
    lens = torch.randint(0, 2049, (32,), generator=gen)
    lens[:3] = torch.tensor([0, 1, 2048])
    case = make_case(lens.tolist(), num_kv_heads=8, group=group, head_dim=128, block_size=16,
                     max_blocks=128, dtype=dtype, seed=group)
    for num_splits in (None, 1, 7):
        assert_matches_reference(case, num_splits)


@pytest.mark.cuda
@requires_cuda
def test_cuda_graph_replay_follows_new_context_lens():
    case = make_case([100, 0, 500, 31], num_kv_heads=2, group=4, head_dim=128, block_size=16,
                     max_blocks=32, dtype=torch.bfloat16)
    out = torch.empty_like(case.q)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale)
    paged_decode_attention(*args, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*args, out=out)

    # Shrinking contexts in place keeps every read inside the original live slots.
    case.context_lens.copy_(torch.tensor([7, 0, 499, 0], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert (out[[1, 3]] == 0).all()
    torch.testing.assert_close(out.double(), case.reference(), rtol=0, atol=3e-2)
