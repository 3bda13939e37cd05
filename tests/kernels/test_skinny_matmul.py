"""The Triton product for decode batches (`kernels/skinny_matmul.py`) against torch's
`F.linear` in float64 (run by the Triton interpreter on a CPU, compiled on a GPU by
`make gpu-test`)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from fastgen.kernels.skinny_matmul import SKINNY_ROWS, SkinnyTiling, default_skinny_tiling, skinny_matmul
from tests.pairwise import all_pairs_in_make_test

pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype,n,k,rows", all_pairs_in_make_test(
    {"fp32": (torch.float32,), "bf16": (torch.bfloat16,)},
    {f"{n}x{k}": (n, k) for n, k in [(70, 96), (64, 1024), (33, 40)]}, {f"rows{r}": (r,) for r in (1, 2, 3, 8)}))
def test_skinny_matmul_equals_linear(rows, n, k, dtype):
    """Ragged N (a last program with fewer rows), K in one step, in several, and a K shorter than
    a step; with and without bias."""
    torch.manual_seed(rows * n + k)
    x, weight, bias = torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
    for b in (bias, None):
        want = F.linear(x.double(), weight.double(), None if b is None else b.double())
        got = skinny_matmul(x.to(DEVICE), weight.to(DEVICE), None if b is None else b.to(DEVICE))
        assert got.shape == (rows, n) and got.dtype == dtype
        tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=0.1)
        torch.testing.assert_close(got.cpu().double(), want, **tolerance)


@pytest.mark.parametrize("tiling", [SkinnyTiling(1, 16), SkinnyTiling(4, 64, 2), SkinnyTiling(16, 32, 8)], ids=str)
def test_every_tiling_gives_the_product(tiling):
    """A K that no step width divides (masked last step), strided x rows, leading dimensions."""
    torch.manual_seed(tiling.block_n)
    base = torch.randn(2, 3, 200)
    x = base[..., :100]  # rows 200 apart
    weight = torch.randn(37, 100)
    got = skinny_matmul(x.to(DEVICE), weight.to(DEVICE), tiling=tiling)
    assert got.shape == (2, 3, 37)
    torch.testing.assert_close(got.cpu().double(), F.linear(x.double(), weight.double()), rtol=1e-5, atol=1e-4)


def test_a_strided_bias_is_read_as_its_values():
    torch.manual_seed(5)
    x, weight, bias = torch.randn(2, 64), torch.randn(16, 64), torch.randn(32)[::2]
    got = skinny_matmul(x.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE))
    torch.testing.assert_close(got.cpu().double(), F.linear(x.double(), weight.double(), bias.double()),
                               rtol=1e-5, atol=1e-4)


def test_a_row_does_not_depend_on_the_others():
    """The first row's product is the same alone and in a batch (each row is summed on its own)."""
    torch.manual_seed(3)
    x, weight = torch.randn(SKINNY_ROWS, 300).to(DEVICE), torch.randn(50, 300).to(DEVICE)
    alone = skinny_matmul(x[:1], weight)
    for rows in range(2, SKINNY_ROWS + 1):
        assert torch.equal(skinny_matmul(x[:rows], weight)[:1], alone)


def test_the_default_tiling_takes_k_in_long_steps():
    assert default_skinny_tiling(2048) == SkinnyTiling(2, 1024)
    assert default_skinny_tiling(100) == SkinnyTiling(2, 128)


def test_a_wider_default_step_takes_all_of_k_at_once(monkeypatch):
    """`SKINNY_MAX_BLOCK_K` 4,096 (`gpu_decode.py --skinny-block-k`): Qwen3-0.6B's down_proj
    (K 3,072) in one masked step, its whole weight read before the wait."""
    monkeypatch.setattr(importlib.import_module("fastgen.kernels.skinny_matmul"), "SKINNY_MAX_BLOCK_K", 4096)
    assert default_skinny_tiling(3072) == SkinnyTiling(2, 4096)
    torch.manual_seed(6)
    x, weight = torch.randn(2, 3072), torch.randn(9, 3072)
    got = skinny_matmul(x.to(DEVICE), weight.to(DEVICE))
    torch.testing.assert_close(got.cpu().double(), F.linear(x.double(), weight.double()), rtol=1e-5, atol=1e-4)


def test_bad_shapes_and_dtypes_are_refused():
    x, weight = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="do not fit"):
        skinny_matmul(x, torch.randn(8, 17))
    with pytest.raises(ValueError, match="do not fit"):
        skinny_matmul(x, weight, torch.randn(9))
    with pytest.raises(ValueError, match="must be one of"):
        skinny_matmul(x, weight.half())
    with pytest.raises(ValueError, match=f"at most {SKINNY_ROWS}"):
        skinny_matmul(torch.randn(SKINNY_ROWS + 1, 16), weight)
