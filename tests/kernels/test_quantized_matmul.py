"""The Triton weight-only quantized matmul against dequantize-then-matmul (run by the Triton
interpreter on a CPU, compiled on a GPU by `make gpu-test`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastgen.kernels.quantized_matmul import quantized_matmul
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


def test_quantized_matmul_refuses_a_layout_that_does_not_fit():
    codes, scales, _ = quantize_weight(torch.randn(8, 64), QuantFormat(4, 32))
    with pytest.raises(ValueError, match=r"do not fit 4-bit codes in groups of 16"):
        quantized_matmul(torch.randn(2, 64), codes, scales, None, None, 4, 16)
