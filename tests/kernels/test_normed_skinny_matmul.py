"""The fused RMSNorm + product (+ SwiGLU) of decode batches (`kernels/normed_skinny_matmul.py`)
against the unfused ops it replaces (`fastgen.compile.ops`, eager, then `F.linear` in float64)
— run by the Triton interpreter on a CPU, compiled on a GPU by `make gpu-test`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastgen.compile import ops
from fastgen.kernels.normed_skinny_matmul import (
    MAX_NORMED_K,
    NormedTiling,
    default_normed_tiling,
    normed_skinny_matmul,
)
from fastgen.kernels.skinny_matmul import SKINNY_ROWS

pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def unfused(x, residual, norm_weight, weight, bias, swiglu):
    """What a layer computes without the kernel: (y in float64, new residual)."""
    if residual is None:
        normed, new_residual = ops.rms_norm(x, norm_weight, EPS), x
    else:
        normed, new_residual = ops.add_rms_norm(x, residual, norm_weight, EPS)
    y = F.linear(normed.double(), weight.double(), None if bias is None else bias.double())
    if swiglu:  # the product is rounded to the dtype before the activation, as a layer's is
        y = ops.silu_and_mul(y.to(x.dtype)).double()
    return y, new_residual


def case(rows, n, k, dtype, residual=True, bias=False, swiglu=False, seed=0):
    torch.manual_seed(seed)
    n_total = 2 * n if swiglu else n
    x = torch.randn(rows, k).to(dtype)
    res = torch.randn(rows, k).to(dtype) if residual else None
    norm_weight = (1 + 0.1 * torch.randn(k)).to(dtype)
    weight = (torch.randn(n_total, k) / k**0.5).to(dtype)
    b = torch.randn(n_total).to(dtype) if bias else None
    return x, res, norm_weight, weight, b


def on_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


def assert_same_in_dtype(got, want):
    """Bit for bit on a GPU. Triton's interpreter truncates float32 to bfloat16 where the GPU
    rounds to nearest, so there a bfloat16 value may sit one unit lower."""
    if DEVICE == "cpu" and want.dtype == torch.bfloat16:
        torch.testing.assert_close(got.cpu(), want, rtol=2**-7, atol=0)
    else:
        assert torch.equal(got.cpu(), want)


def tolerance(dtype):
    """float32 pins the arithmetic; bfloat16 rounds four times on the way (norm, weight, product,
    silu), each a unit or two of 2**-8 apart from the reference's (truncated in the interpreter)."""
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=8e-2)


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("n,k", [(70, 96), (64, 1024), (9, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("swiglu", [False, True], ids=["product", "swiglu"])
def test_the_fused_kernel_equals_the_ops_it_replaces(rows, n, k, dtype, swiglu):
    """Ragged N (a last program with fewer columns), K a power of two or not; the new residual
    is exactly x + residual in the dtype."""
    x, res, norm_weight, weight, _ = case(rows, n, k, dtype, swiglu=swiglu, seed=rows * n + k)
    want, want_residual = unfused(x, res, norm_weight, weight, None, swiglu)
    got, got_residual = normed_skinny_matmul(*on_device(x, res, norm_weight), EPS, *on_device(weight), swiglu=swiglu)
    assert got.shape == (rows, n) and got.dtype == dtype
    torch.testing.assert_close(got.cpu().double(), want, **tolerance(dtype))
    assert_same_in_dtype(got_residual, want_residual)


@pytest.mark.parametrize("swiglu", [False, True], ids=["product", "swiglu"])
def test_without_a_residual_x_is_normed_as_it_is_and_is_the_new_residual(swiglu):
    x, _, norm_weight, weight, bias = case(2, 48, 64, torch.float32, residual=False, bias=True, swiglu=swiglu)
    want, _ = unfused(x, None, norm_weight, weight, bias, swiglu)
    x_dev = x.to(DEVICE)
    got, new_residual = normed_skinny_matmul(x_dev, None, *on_device(norm_weight), EPS, *on_device(weight, bias),
                                             swiglu=swiglu)
    torch.testing.assert_close(got.cpu().double(), want, **tolerance(torch.float32))
    assert new_residual is x_dev


@pytest.mark.parametrize("tiling", [NormedTiling(1, 1), NormedTiling(8, 2), NormedTiling(16, 8)], ids=str)
def test_every_tiling_gives_the_product_with_bias(tiling):
    x, res, norm_weight, weight, bias = case(2, 37, 100, torch.float32, bias=True, swiglu=True, seed=tiling.block_n)
    want, _ = unfused(x, res, norm_weight, weight, bias, True)
    got, _ = normed_skinny_matmul(*on_device(x, res, norm_weight), EPS, *on_device(weight, bias), swiglu=True,
                                  tiling=tiling)
    torch.testing.assert_close(got.cpu().double(), want, **tolerance(torch.float32))


def test_leading_dimensions_and_strided_rows_are_kept():
    torch.manual_seed(4)
    base, res = torch.randn(2, 1, 128), torch.randn(2, 1, 64)
    x = base[..., :64]  # rows 128 apart
    norm_weight, weight = torch.rand(64) + 0.5, torch.randn(20, 64)
    want, want_residual = unfused(x, res, norm_weight, weight, None, False)
    got, got_residual = normed_skinny_matmul(*on_device(x, res, norm_weight), EPS, *on_device(weight))
    assert got.shape == (2, 1, 20) and got_residual.shape == (2, 1, 64)
    torch.testing.assert_close(got.cpu().double(), want, **tolerance(torch.float32))
    assert_same_in_dtype(got_residual, want_residual)


def test_a_row_does_not_depend_on_the_others():
    x, res, norm_weight, weight, _ = case(SKINNY_ROWS, 24, 96, torch.bfloat16, swiglu=True, seed=9)
    x, res, norm_weight, weight = on_device(x, res, norm_weight, weight)
    alone, _ = normed_skinny_matmul(x[:1], res[:1], norm_weight, EPS, weight, swiglu=True)
    for rows in (2, 5, SKINNY_ROWS):
        assert torch.equal(normed_skinny_matmul(x[:rows], res[:rows], norm_weight, EPS, weight, swiglu=True)[0][:1],
                           alone)


def test_the_default_tiling_widens_with_k():
    assert default_normed_tiling(1024) == NormedTiling(8, 4)
    assert default_normed_tiling(4096) == NormedTiling(4, 8)


def test_bad_shapes_and_dtypes_are_refused():
    x, norm_weight, weight = torch.randn(2, 16), torch.ones(16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="do not fit"):
        normed_skinny_matmul(x, torch.randn(2, 17), norm_weight, EPS, weight)
    with pytest.raises(ValueError, match="do not fit"):
        normed_skinny_matmul(x, None, torch.ones(15), EPS, weight)
    with pytest.raises(ValueError, match="do not fit"):
        normed_skinny_matmul(x, None, norm_weight, EPS, torch.randn(7, 16), swiglu=True)
    with pytest.raises(ValueError, match="must be one of"):
        normed_skinny_matmul(x, None, norm_weight.half(), EPS, weight)
    with pytest.raises(ValueError, match=f"at most {SKINNY_ROWS} of {MAX_NORMED_K}"):
        normed_skinny_matmul(torch.randn(SKINNY_ROWS + 1, 16), None, norm_weight, EPS, weight)
    with pytest.raises(ValueError, match=f"at most {SKINNY_ROWS} of {MAX_NORMED_K}"):
        k = MAX_NORMED_K + 1
        normed_skinny_matmul(torch.randn(1, k), None, torch.ones(k), EPS, torch.randn(2, k))
