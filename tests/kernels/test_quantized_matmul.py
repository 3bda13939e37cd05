"""The Triton weight-only quantized matmul against dequantize-then-matmul (run by the Triton
interpreter on a CPU, compiled on a GPU by `make gpu-test`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastgen.kernels.quantized_matmul import Tiling, quantized_matmul, split_k_for
from fastgen.quantization.formats import QuantFormat
from fastgen.quantization.quantize import dequantize, quantize_weight

pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("fmt", [QuantFormat(8, 96), QuantFormat(8, 32), QuantFormat(4, 32),
                                 QuantFormat(4, 32, has_mins=True), QuantFormat(4, 48)], ids=str)
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_matmul_equals_dequantize_then_matmul(fmt, rows, dtype):
    torch.manual_seed(rows)
    weight = torch.randn(70, 96)
    codes, scales, _ = quantize_weight(weight, QuantFormat(fmt.bits, fmt.group_size))
    mins = (-scales.float() * (4 + 8 * torch.rand(scales.shape))).half() if fmt.has_mins else None
    x, bias = torch.randn(rows, 96).to(dtype), torch.randn(70).to(dtype)
    # The reference: the weight rounded to x's dtype, products and sums in float32.
    want = F.linear(x.float(), dequantize(codes, scales, mins, fmt, dtype).float(), bias.float())
    args = [t.to(DEVICE) if t is not None else None for t in (x, codes, scales, mins, bias)]
    got = quantized_matmul(*args, fmt.bits, fmt.group_size)
    assert got.shape == (rows, 70) and got.dtype == dtype
    tolerance = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=1e-2, atol=0.25)
    torch.testing.assert_close(got.cpu().float(), want, **tolerance)


@pytest.mark.parametrize("fmt", [QuantFormat(8, 512), QuantFormat(4, 64, has_mins=True), QuantFormat(4, 32)], ids=str)
@pytest.mark.parametrize("rows,split_k", [(1, 3), (3, 4), (20, 2), (2, None)])
def test_k_split_between_programs_adds_up(fmt, rows, split_k):
    """K cut into slices whose float32 partial sums are added after the kernel (decode batches on
    a GPU); the last slice shorter than the others."""
    torch.manual_seed(split_k or 0)
    weight = torch.randn(24, 512)
    codes, scales, _ = quantize_weight(weight, QuantFormat(fmt.bits, fmt.group_size))
    mins = (-scales.float() * 6).half() if fmt.has_mins else None
    x, bias = torch.randn(rows, 512), torch.randn(24)
    want = F.linear(x, dequantize(codes, scales, mins, fmt, torch.float32), bias)
    args = [t.to(DEVICE) if t is not None else None for t in (x, codes, scales, mins, bias)]
    got = quantized_matmul(*args, fmt.bits, fmt.group_size, split_k=split_k)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [2, 20])
@pytest.mark.parametrize("tiling", [Tiling(8, 32), Tiling(16, 128), Tiling(32, 128, group_scales=False)],
                         ids=["step-in-one-group", "groups-in-one-step", "scale-per-byte"])
def test_each_way_of_reading_scales_gives_the_product(bits, rows, tiling):
    """Scales (and minimums) read once a row per step, once a group, or once a byte."""
    fmt = QuantFormat(bits, 64, has_mins=bits == 4)
    torch.manual_seed(rows)
    codes, scales, _ = quantize_weight(torch.randn(40, 256), QuantFormat(bits, 64))
    mins = (-scales.float() * 7).half() if fmt.has_mins else None
    x = torch.randn(rows, 256)
    want = F.linear(x, dequantize(codes, scales, mins, fmt, torch.float32))
    args = [t.to(DEVICE) if t is not None else None for t in (x, codes, scales, mins)]
    got = quantized_matmul(*args, None, bits, 64, tiling=tiling)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-3)


def test_split_count_fills_the_gpu_and_never_exceeds_the_k_steps():
    assert split_k_for(tiles=64, steps=24, programs_wanted=264) == 5
    assert split_k_for(tiles=9496, steps=8, programs_wanted=264) == 1
    assert split_k_for(tiles=1, steps=3, programs_wanted=264) == 3


def test_quantized_matmul_refuses_a_layout_that_does_not_fit():
    codes, scales, _ = quantize_weight(torch.randn(8, 64), QuantFormat(4, 32))
    with pytest.raises(ValueError, match=r"do not fit 4-bit codes in groups of 16"):
        quantized_matmul(torch.randn(2, 64), codes, scales, None, None, 4, 16)
