"""paged_decode_attention (Triton, split-KV, tl.dot for every group size) matches a float64
torch reference; each sequence's split count follows its own context length."""

import importlib
import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastgen.kernels import decode_split_policy, paged_decode_attention, paged_decode_attention_torch  # noqa: E402
from fastgen.kernels.decode_split_policy import (  # noqa: E402
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    grid_splits,
    splits_for_lengths,
)

from tests.kernels.paged_cases import DEVICE, TOLERANCE, int32, paged_cache, record_decode_launches  # noqa: E402

# The module (the package exports its function under the same name).
launcher = importlib.import_module("fastgen.kernels.paged_decode_attention")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = pytest.mark.triton


@dataclass
class DecodeCase:
    q: torch.Tensor  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [batch, max_blocks_per_seq] int32, -1 padded
    context_lens: torch.Tensor  # [batch] int32

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5

    @property
    def args(self):
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.scale

    def reference(self) -> torch.Tensor:
        """The float64 oracle (the NaN slots are never in a context, so it never sees them)."""
        return paged_decode_attention_torch(
            self.q.double(), self.k_cache.double(), self.v_cache.double(),
            self.block_tables, self.context_lens, self.scale,
        )


def make_case(context_lens, num_kv_heads, group, head_dim, block_size, max_blocks, dtype, seed=0, spare_blocks=3):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = paged_cache(context_lens, num_kv_heads, head_dim, block_size, max_blocks, dtype,
                                           gen, spare_blocks)
    q = torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=gen)
    return DecodeCase(q.to(dtype).to(DEVICE), k_cache, v_cache, tables, int32(context_lens))


def assert_matches_reference(case: DecodeCase, max_splits) -> None:
    out = paged_decode_attention(*case.args, max_splits=max_splits)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert not out.isnan().any(), "a slot outside some context was read"
    empty = case.context_lens == 0
    assert (out[empty] == 0).all(), "context_len 0 rows must be exact zeros"
    torch.testing.assert_close(out.double(), case.reference(), rtol=0, atol=TOLERANCE[case.q.dtype])


# (context_lens, num_kv_heads, group, head_dim, block_size, max_blocks, dtype): every group size
# 1/2/4/8 with head dims 64 and 128 and block sizes 1/16/256, context-0 rows throughout, and
# lengths on both sides of the one-split threshold (MIN_TOKENS_PER_SPLIT = 128).
SHAPES = {
    "mha-d64-bs16-fp32": ([0, 37, 300], 2, 1, 64, 16, 20, torch.float32),
    "mha-d128-bs256-bf16": ([129, 0, 600], 2, 1, 128, 256, 3, torch.bfloat16),
    "gqa2-d128-bs16-fp32": ([0, 16, 260], 1, 2, 128, 16, 17, torch.float32),
    "gqa2-d64-bs1-bf16": ([140, 0, 3], 2, 2, 64, 1, 140, torch.bfloat16),
    "gqa4-d64-bs1-fp32": ([9, 0, 200], 1, 4, 64, 1, 200, torch.float32),
    "gqa4-d128-bs16-fp16": ([0, 1, 15, 16, 17, 33, 48, 257], 1, 4, 128, 16, 17, torch.float16),
    "gqa8-d128-bs256-bf16": ([300, 1, 0], 1, 8, 128, 256, 2, torch.bfloat16),
    "gqa8-d64-bs16-fp32": ([0, 129, 64], 2, 8, 64, 16, 9, torch.float32),
    # Odd shapes: a head dim that pads (48), a block size that is no power of two (3).
    "mha-d48-bs3-fp32": ([7, 0, 150], 2, 1, 48, 3, 50, torch.float32),
    "gqa3-d32-bs5-fp32": ([11, 0, 4], 2, 3, 32, 5, 3, torch.float32),
}


# The combine in the last split is off by default (measured slower on a GPU): test-slow and
# `make gpu-test` take it.
@pytest.fixture(params=["combine-launch", pytest.param("combine-in-last-split", marks=pytest.mark.slow)])
def combine(request, monkeypatch) -> str:
    """Both ways of combining a sequence's splits: a second launch, or the split kernel's last
    program of each (sequence, KV head)."""
    monkeypatch.setattr(launcher, "COMBINE_IN_LAST_SPLIT", request.param == "combine-in-last-split")
    return request.param


@pytest.mark.parametrize("max_splits", [1, 3, None], ids=["grid1", "grid3", "grid-auto"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_float64_reference(shape, max_splits, combine):
    if max_splits == 1 and combine == "combine-in-last-split":
        pytest.skip("one split has nothing to combine")
    assert_matches_reference(make_case(*shape, seed=len(shape[0])), max_splits)


@pytest.mark.parametrize("min_tokens", [16, 32, 64])
def test_shorter_splits_match_the_reference(min_tokens, monkeypatch):
    """Splits shorter than a KV tile (`MIN_TOKENS_PER_SPLIT`, read at each launch: the GPU
    benchmark's --min-tokens-per-split) attend over exactly their own tokens."""
    monkeypatch.setattr(decode_split_policy, "MIN_TOKENS_PER_SPLIT", min_tokens)
    seen = record_decode_launches(monkeypatch, "MIN_TOKENS")
    for shape in (SHAPES["gqa4-d128-bs16-fp16"], SHAPES["mha-d64-bs16-fp32"]):
        assert_matches_reference(make_case(*shape, seed=len(shape[0])), None)
    assert seen == [min_tokens, min_tokens]


@pytest.mark.slow  # off by default, as above
def test_the_last_split_combines_and_leaves_the_counters_at_zero_for_the_next_launch(monkeypatch):
    """In-kernel combining: no combine launch, every counter back at zero after each call (what
    the next layer, step or graph replay needs), and a second call over shorter lengths (other
    split counts), reusing the counters, still right."""
    monkeypatch.setattr(launcher, "COMBINE_IN_LAST_SPLIT", True)
    launched = []
    monkeypatch.setattr(launcher, "decode_combine_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: launched.append(grid)})())
    case = make_case([0, 700, 129, 300, 5], num_kv_heads=2, group=4, head_dim=64, block_size=16,
                     max_blocks=44, dtype=torch.float32)
    for lens in ([0, 700, 129, 300, 5], [0, 400, 100, 290, 5]):  # within the first's live slots
        case.context_lens.copy_(int32(lens))
        assert_matches_reference(case, max_splits=6)
        counters = launcher.splits_done_counters(case.q.device, 10)
        assert (counters == 0).all()
    assert launched == []


def test_padding_rows_with_all_minus_one_tables_read_no_kv():
    # The cache is NaN everywhere except row 1's tokens; rows 0 and 2 are CUDA-graph padding.
    case = make_case([0, 200, 0], num_kv_heads=2, group=2, head_dim=64, block_size=16,
                     max_blocks=13, dtype=torch.float32, spare_blocks=0)
    assert (case.block_tables[[0, 2]] == -1).all()
    out = paged_decode_attention(*case.args, max_splits=4)
    assert (out[[0, 2]] == 0).all()
    torch.testing.assert_close(out.double(), case.reference(), rtol=0, atol=2e-3)


def test_writes_into_given_out_buffer():
    case = make_case([5, 0, 300], num_kv_heads=1, group=1, head_dim=32, block_size=4,
                     max_blocks=75, dtype=torch.float32)
    out = torch.full_like(case.q, 7.0)
    result = paged_decode_attention(*case.args, max_splits=4, out=out)
    assert result is out
    torch.testing.assert_close(out.double(), case.reference(), rtol=0, atol=2e-3)


def test_grid_splits_fill_the_gpu_from_shapes_only():
    # One sequence, 8 KV heads, 132 SMs: about two programs per SM.
    assert grid_splits(1, 8, 32768, sms=132) == 33
    # Never more than MAX_SPLITS, nor more than the block table's reach could use.
    assert grid_splits(1, 1, 32768, sms=132) == MAX_SPLITS
    assert grid_splits(1, 1, 300, sms=132) == 3
    # A big batch already fills the GPU: one split, no combine launch.
    assert grid_splits(256, 8, 4096, sms=132) == 1
    assert grid_splits(1, 1, 0, sms=132) == 1


def test_each_sequence_splits_by_its_own_length():
    lens = int32([0, 1, MIN_TOKENS_PER_SPLIT, MIN_TOKENS_PER_SPLIT + 1, 5 * MIN_TOKENS_PER_SPLIT, 10**6])
    assert splits_for_lengths(lens, grid=8).tolist() == [1, 1, 1, 2, 5, 8]
    assert splits_for_lengths(lens, grid=1).tolist() == [1] * 6


def test_kernel_writes_partials_only_for_the_splits_a_length_asks_for(monkeypatch):
    """The split kernel's scratch (NaN beforehand) is written for exactly the splits each
    sequence's length asks for, and not at all for one-split sequences (those go straight to
    the output); the combine then reads only those."""
    lens = [0, 100, 129, 3 * MIN_TOKENS_PER_SPLIT + 5, 700]
    case = make_case(lens, num_kv_heads=1, group=2, head_dim=32, block_size=16, max_blocks=44,
                     dtype=torch.float32)
    scratch = []
    real_empty = torch.empty

    def recording_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs).fill_(float("nan"))
        scratch.append(t)
        return t

    monkeypatch.setattr(torch, "empty", recording_empty)  # the launcher's scratch allocations
    out = paged_decode_attention(*case.args, max_splits=4)
    torch.testing.assert_close(out.double(), case.reference(), rtol=0, atol=2e-3)
    part_max = scratch[1]  # [batch, num_heads, grid]
    written = (~part_max.isnan()).sum(-1)[:, 0].tolist()  # splits written, head 0
    expected = [n if n > 1 else 0 for n in splits_for_lengths(int32(lens), 4).tolist()]
    assert expected == [0, 0, 2, 4, 4]
    assert written == expected


def test_rejects_heads_not_multiple_of_kv_heads():
    case = make_case([4], num_kv_heads=2, group=1, head_dim=16, block_size=4, max_blocks=1,
                     dtype=torch.float32)
    q = torch.zeros(1, 3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 1.0)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 2, 4, 8], ids=["mha", "gqa2", "gqa4", "gqa8"])
def test_large_shapes_on_cuda(group, dtype, combine):
    gen = torch.Generator().manual_seed(group)
    lens = torch.randint(0, 4097, (32,), generator=gen)
    lens[:3] = torch.tensor([0, 1, 4096])
    case = make_case(lens.tolist(), num_kv_heads=8, group=group, head_dim=128, block_size=16,
                     max_blocks=256, dtype=dtype, seed=group)
    for max_splits in (None, 1, 7, MAX_SPLITS):
        assert_matches_reference(case, max_splits)


@pytest.mark.cuda
@requires_cuda
def test_cuda_graph_replay_follows_new_context_lens(combine):
    case = make_case([100, 0, 2000, 31], num_kv_heads=2, group=4, head_dim=128, block_size=16,
                     max_blocks=128, dtype=torch.bfloat16)
    out = torch.empty_like(case.q)
    paged_decode_attention(*case.args, max_splits=8, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*case.args, max_splits=8, out=out)

    # Shrinking contexts in place keeps every read inside the original live slots, and moves
    # rows across the one-split threshold both ways.
    case.context_lens.copy_(torch.tensor([7, 0, 1999, 0], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert (out[[1, 3]] == 0).all()
    torch.testing.assert_close(out.double(), case.reference(), rtol=0, atol=3e-2)


@pytest.mark.cuda
@requires_cuda
def test_the_last_split_combines_right_over_many_graph_replays(monkeypatch):
    """The counters' zeroing under real concurrency: a graph of the most splits replayed 50 times
    over changing lengths (splits per sequence from 1 to MAX_SPLITS), each output against the
    reference, the counters at zero after every replay."""
    monkeypatch.setattr(launcher, "COMBINE_IN_LAST_SPLIT", True)
    lens = [4096] * 16
    case = make_case(lens, num_kv_heads=4, group=4, head_dim=128, block_size=16, max_blocks=256,
                     dtype=torch.bfloat16, seed=11)
    out = torch.empty_like(case.q)
    paged_decode_attention(*case.args, max_splits=MAX_SPLITS, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*case.args, max_splits=MAX_SPLITS, out=out)
    gen = torch.Generator().manual_seed(3)
    counters = launcher.splits_done_counters(case.q.device, len(lens) * 4)
    for _ in range(50):
        case.context_lens.copy_(torch.randint(0, 4097, (len(lens),), generator=gen, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.double(), case.reference(), rtol=0, atol=3e-2)
        assert (counters == 0).all()
