"""The quantized layout and each kernel of `fastgen::quantized_linear`, against the reference
F.linear(x, dequantize(...)) (`fastgen.quantization.quantize`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastgen.cpu.native.gemm import gemm_available
from fastgen.cpu.native.quantized_linear import (gemm_rows, kernel_available, load_kernel, pack_quantized_weights,
                                                 products_served_natively, rounds_inputs, set_rounded_inputs,
                                                 twin_bytes)
from fastgen.layers.quantizable import QuantizableWeight
from fastgen.quantization.formats import QuantFormat, linear_format
from fastgen.quantization.ops import quantized_embedding, quantized_linear, quantized_linear_reference
from fastgen.quantization.quantize import dequantize, quantize_weight, unpack_codes

FORMATS = [QuantFormat(8, 64), QuantFormat(8, 32), QuantFormat(4, 32), QuantFormat(4, 64)]


def test_int8_codes_round_to_the_nearest_step_of_each_row():
    torch.manual_seed(0)
    weight = torch.randn(16, 64)
    fmt = QuantFormat(8, 64)
    codes, scales, mins = quantize_weight(weight, fmt)
    assert codes.dtype == torch.int8 and scales.shape == (16, 1) and scales.dtype == torch.float16 and mins is None
    assert codes.abs().amax(-1).tolist() == [127] * 16  # each row's largest weight spans the range
    error = (dequantize(codes, scales, mins, fmt, torch.float32) - weight).abs()
    assert (error <= scales.float() / 2 + 1e-6).all()


def test_int4_layout_is_ggufs_block_order():
    """In a group of G inputs, byte j holds input j (low nibble) and input j + G/2 (high), and the
    value of largest magnitude is exact (Q4_0's rule)."""
    fmt = QuantFormat(4, 32)
    weight = torch.zeros(1, 32)
    weight[0, 3], weight[0, 16 + 3], weight[0, 5] = -8.0, 7.0, 1.0
    codes, scales, _ = quantize_weight(weight, fmt)
    assert codes.shape == (1, 16) and codes.dtype == torch.uint8 and scales.item() == 1.0
    assert codes[0, 3].item() == (0 | (15 << 4))  # input 3 -> code 0 (-8), input 19 -> code 15 (+7)
    assert unpack_codes(codes, fmt)[0, 5].item() == 9
    assert torch.equal(dequantize(codes, scales, None, fmt, torch.float32), weight)


def test_int4_with_minimums_keeps_each_groups_ends_exact():
    """Q4_1's rule: a group's smallest weight is its minimum and its largest is 15 steps above."""
    torch.manual_seed(4)
    fmt = QuantFormat(4, 32, has_mins=True)
    weight = torch.randn(8, 64).half().float()
    codes, scales, mins = quantize_weight(weight, fmt)
    assert mins is not None and mins.dtype == torch.float16 and mins.shape == (8, 2)
    back = dequantize(codes, scales, mins, fmt, torch.float32).view(8, 2, 32)
    groups = weight.view(8, 2, 32)
    torch.testing.assert_close(back.amin(-1), groups.amin(-1), rtol=0, atol=1e-3)
    torch.testing.assert_close(back.amax(-1), groups.amax(-1), rtol=2e-3, atol=2e-3)
    assert ((back - groups).abs() <= scales.float()[..., None] / 2 + 2e-3).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("width", [128, 576])  # 576: more than 16 groups (the bf16 kernel's scale window)
def test_cpu_kernel_equals_dequantize_then_multiply(dtype, fmt, rows, width):
    assert load_kernel() is not None, "the C++ kernel builds wherever fastgen's other CPU kernels do"
    if not kernel_available():
        pytest.skip("the quantized CPU kernels need AVX-512")
    torch.manual_seed(rows)
    weight, x, bias = torch.randn(37, width), torch.randn(rows, width).to(dtype), torch.randn(37).to(dtype)
    codes, scales, mins = quantize_weight(weight, fmt)
    variants = [(mins, bias)]
    if fmt.bits == 4:  # with minimums (GGUF's Q4_1 form): code * scale + min
        variants.append(((torch.rand_like(scales.float()) - 0.5).half(), None))
    # bf16 rows that the integer kernels round to int8 (their own test is below): against the
    # product of the rounded rows.
    rows_in = rounded_rows(x) if dtype == torch.bfloat16 and kernel_rounds(fmt) else x.float()
    for group_mins, b in variants:
        group_fmt = QuantFormat(fmt.bits, fmt.group_size, group_mins is not None)
        dequantized = dequantize(codes, scales, group_mins, group_fmt, torch.float32)
        bias32 = None if b is None else b.float()
        want = F.linear(rows_in, dequantized, bias32)
        served = products_served_natively()
        got = quantized_linear(x, codes, scales, group_mins, b, fmt.bits, fmt.group_size)
        assert products_served_natively() == served + 1
        assert got.dtype == dtype and got.shape == (rows, 37)
        # bf16: outputs of magnitude ~100 round to steps of 0.5; the reference also rounds each
        # dequantized weight to bf16 before its products.
        tolerance = dict(rtol=1e-5, atol=2e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=0.6)
        torch.testing.assert_close(got.float(), want, **tolerance)
        reference = quantized_linear_reference(x, codes, scales, group_mins, b, fmt.bits, fmt.group_size)
        torch.testing.assert_close(reference.float(), F.linear(x.float(), dequantized, bias32), **tolerance)


def kernel_rounds(fmt: QuantFormat) -> bool:
    """Whether the C++ GEMV rounds bf16 rows to int8 for this format (quantized_linear_op.cpp)."""
    served = fmt.group_size % 64 == 0 or fmt.group_size == 32 if fmt.bits == 8 else fmt.group_size == 32
    return served and rounds_inputs()


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the integer kernels round it: int8 in blocks of 32 inputs, each block's scale
    its largest magnitude / 127, halves to even; back in float32."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # 127 / amax rounded once, as the kernel does (a scalar over a tensor takes a reciprocal first)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 127)).reshape(x.shape)


@pytest.mark.parametrize("fmt", [QuantFormat(8, 192), QuantFormat(8, 64), QuantFormat(8, 32), QuantFormat(4, 32),
                                 QuantFormat(4, 32, has_mins=True)], ids=str)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("width", [96, 576, 1536])  # 96: a chunk of 64 inputs and half of one
def test_bf16_rows_rounded_to_int8_give_the_product_of_the_rounded_rows(fmt, rows, width):
    """The integer dot-product kernels (AVX-512 VNNI): bf16 rows rounded to int8 in blocks of 32,
    as llama.cpp rounds its activations; the product is the rounded rows' (closer to it than to
    the product of the rows as they are), and switched off the rows go in as they are."""
    load_kernel()
    if not rounds_inputs():
        pytest.skip("rounding the inputs needs AVX-512 VNNI")
    if width % fmt.group_size:
        pytest.skip("the group does not divide the width")
    torch.manual_seed(width + rows)
    weight, x = torch.randn(45, width) * 0.05, torch.randn(rows, width).to(torch.bfloat16)
    x[:, :32] *= 20  # blocks of other magnitudes: one scale a block, not a row
    codes, scales, mins = quantize_weight(weight, fmt)
    dequantized = dequantize(codes, scales, mins, fmt, torch.float32)
    rounded_product = rounded_rows(x) @ dequantized.T
    plain_product = x.float() @ dequantized.T
    got = quantized_linear(x, codes, scales, mins, None, fmt.bits, fmt.group_size).float()
    torch.testing.assert_close(got, rounded_product, rtol=8e-3, atol=2e-2)
    assert (got - rounded_product).abs().mean() < 0.5 * (got - plain_product).abs().mean()
    set_rounded_inputs(False)
    try:
        plain = quantized_linear(x, codes, scales, mins, None, fmt.bits, fmt.group_size).float()
    finally:
        set_rounded_inputs(True)
    assert (plain - plain_product).abs().mean() < 0.5 * (plain - rounded_product).abs().mean()


def test_a_nan_in_a_rounded_row_reaches_its_outputs():
    """Rounding a row must not drop a NaN (max ignores it), nor turn a block of tiny values into
    NaNs: the float kernels' answers."""
    load_kernel()
    if not rounds_inputs():
        pytest.skip("rounding the inputs needs AVX-512 VNNI")
    fmt = QuantFormat(8, 64)
    codes, scales, _ = quantize_weight(torch.randn(8, 64), fmt)
    x = torch.randn(3, 64).to(torch.bfloat16)
    x[0, 5] = float("nan")
    x[1, :32] = 1e-38  # 127 / amax is not finite
    got = quantized_linear(x, codes, scales, None, None, 8, 64).float()
    assert got[0].isnan().all() and not got[1:].isnan().any()
    want = rounded_rows(x[1:2].clone().index_fill_(1, torch.arange(32), 0)) @ dequantize(codes, scales, None, fmt,
                                                                                          torch.float32).T
    torch.testing.assert_close(got[1:2], want, rtol=8e-3, atol=2e-2)


def test_products_the_kernel_cannot_serve_go_to_the_reference():
    """A group of 16 (not a multiple of 32) and a half-precision input: the Python kernel answers."""
    load_kernel()
    torch.manual_seed(2)
    fmt = QuantFormat(4, 16)
    codes, scales, _ = quantize_weight(torch.randn(8, 64), fmt)
    x = torch.randn(2, 64)
    served = products_served_natively()
    got = quantized_linear(x, codes, scales, None, None, 4, 16)
    assert products_served_natively() == served
    torch.testing.assert_close(got, F.linear(x, dequantize(codes, scales, None, fmt, torch.float32)))


def test_quantized_embedding_dequantizes_the_rows_looked_up():
    torch.manual_seed(3)
    fmt = QuantFormat(8, 16)
    codes, scales, mins = quantize_weight(torch.randn(50, 16), fmt)
    ids = torch.tensor([[3, 49], [0, 3]])
    got = quantized_embedding(ids, codes, scales, mins, fmt, torch.float32)
    assert torch.equal(got, F.embedding(ids, dequantize(codes, scales, mins, fmt, torch.float32)))


def test_formats_refuse_what_they_cannot_hold():
    assert linear_format("int4", None, 96, "x") == QuantFormat(4, 32, has_mins=True)
    assert linear_format("int8", None, 96, "x") == QuantFormat(8, 96)
    with pytest.raises(ValueError, match=r"group_size=7 does not fit layers\.0\.mlp: it must divide its 96"):
        linear_format("int4", 7, 96, "layers.0.mlp")
    with pytest.raises(ValueError, match=r"quantization_group_size=3 .*even for 4-bit"):
        linear_format("int4", 3, 96, "x")
    with pytest.raises(ValueError, match=r"quantization='int3' is not one of \['int8', 'int4'\]"):
        linear_format("int3", None, 96, "x")


class QuantizedLinear(QuantizableWeight, nn.Linear):
    def forward(self, x):
        return self.product(x, self.bias)


@pytest.mark.parametrize("fmt", FORMATS + [QuantFormat(4, 32, has_mins=True)], ids=str)
@pytest.mark.parametrize("rows", [2, 3, 4, 9, 40, 64, 300, 1000, 2000])  # 300: more than one chunk of rows
def test_many_rows_go_through_the_gemm_over_the_packed_twin(fmt, rows):
    """Four rows or more in bf16 (where the GEMV rounds its rows: past 1 MiB of rounded rows), with
    a twin: the bf16 GEMM over dequantized panels (the weight rounded
    to bf16 first, as the reference does). 100 outputs: two whole panels and a part."""
    if not gemm_available() or not kernel_available():
        pytest.skip("fastgen's bf16 GEMM needs AVX-512 BF16")
    torch.manual_seed(rows)
    layer = QuantizedLinear(576, 100, bias=True, dtype=torch.bfloat16)
    tensors = quantize_weight(layer.weight, QuantFormat(fmt.bits, fmt.group_size))
    if fmt.has_mins:
        # Q4_1's minimums: each group's lowest weight, some 4 to 12 steps below zero
        tensors = tensors._replace(mins=(-tensors.scales.float() * (4 + 8 * torch.rand(tensors.scales.shape))).half())
    layer.quantize_(fmt, tensors)
    # Where the GEMV rounds its rows to int8 it stays ahead of the GEMM up to 1 MiB of rounded rows
    # (1,820 rows of 576 inputs).
    threshold = gemm_rows(fmt, 576)
    assert threshold == (4 if not kernel_rounds(fmt) else 1024 * 1024 // 576)
    assert pack_quantized_weights(layer) == 1 and twin_bytes(layer) > 0
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    weight = dequantize(layer.weight_codes, layer.weight_scales, layer.weight_mins, fmt, torch.bfloat16)
    to_gemm = rows >= threshold
    by_gemm = products_served_natively(by_gemm=True)
    got = layer(x)
    assert products_served_natively(by_gemm=True) == by_gemm + to_gemm
    if to_gemm:
        torch.testing.assert_close(got, F.linear(x, weight, layer.bias), rtol=1e-2, atol=1e-2)
    else:
        want = F.linear(rounded_rows(x), weight.float(), layer.bias.float())
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2)
    alone = layer(x[:1])  # one row: the GEMV (over the row rounded to int8 where the kernel rounds)
    assert products_served_natively(by_gemm=True) == by_gemm + to_gemm
    if kernel_rounds(fmt):
        want = F.linear(rounded_rows(x[:1]), weight.float(), layer.bias.float())
        torch.testing.assert_close(alone.float(), want, rtol=1e-2, atol=2e-2)
    else:
        torch.testing.assert_close(alone, got[:1], rtol=1e-2, atol=1e-2)


def test_the_int8_twins_lanes_order_holds_each_columns_codes():
    """int8 codes + 128, read back through the C++ offsets (panel, block of 32 inputs, set of 16
    columns, run d of four inputs, column, byte); no stored offset (-128 scale, taken in float32)."""
    from fastgen.cpu.native.quantized_linear import pack_twin

    fmt = QuantFormat(8, 64)
    codes, scales, _ = quantize_weight(torch.randn(100, 128), fmt)
    twin = pack_twin(codes, scales, None, fmt)
    flat = twin.codes.reshape(-1)
    for column in range(144):
        panel, set_, c = column // 48, column % 48 // 16, column % 16
        for k in range(128):
            block, within = k // 32, k % 32
            byte = flat[panel * 128 * 48 + block * 1536 + set_ * 512 + within // 4 * 64 + 4 * c + within % 4]
            assert int(byte) - 128 == (int(codes[column, k]) if column < 100 else 0), (column, k)
    assert twin.offsets is None  # the readers take -128 scale in float32


def test_int8_scales_too_large_for_a_float16_offset_stay_finite():
    """A group whose scale passes 511.75 (-128 scale would overflow float16): the twin's GEMV and
    GEMM give the reference's product."""
    if not gemm_available() or not kernel_available() or not rounds_inputs():
        pytest.skip("the twin's kernels need AVX-512 VNNI and the bf16 GEMM")
    fmt = QuantFormat(8, 64)
    layer = QuantizedLinear(576, 50, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight[3, 5] = 1e5
    layer.quantize_(fmt)
    assert layer.weight_scales.float().max() > 512
    assert pack_quantized_weights(layer) == 1
    weight = dequantize(layer.weight_codes, layer.weight_scales, None, fmt, torch.bfloat16)
    for rows in (1, 5, 2000):  # the GEMV over the twin; the GEMM from 1 MiB of rounded rows
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        by_gemm = products_served_natively(by_gemm=True)
        got = layer(x).float()
        assert products_served_natively(by_gemm=True) == by_gemm + (rows == 2000)
        assert torch.isfinite(got).all()
        want = F.linear(rounded_rows(x) if rows < 2000 else x.float(), weight.float())
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2.0)


def test_the_4bit_twins_lanes_order_holds_each_columns_codes():
    """Read back through the byte offsets the C++ GEMV and GEMM use (panel, block of 32 inputs,
    set of 16 columns, 4-byte run d, column, byte j: input j low, input j + 16 high), the twin
    gives `unpack_codes`' values; columns past N are zero."""
    from fastgen.cpu.native.quantized_linear import pack_twin

    for group in (32, 64):
        fmt = QuantFormat(4, group, has_mins=True)
        codes, scales, _ = quantize_weight(torch.randn(100, 128), QuantFormat(4, group))
        mins = (-scales.float() * 8).half()
        twin = pack_twin(codes, scales, mins, fmt)
        values = unpack_codes(codes, fmt)
        flat = twin.codes.reshape(-1)
        panel_bytes = 128 // 2 * 48
        for column in range(144):
            panel, set_, c = column // 48, column % 48 // 16, column % 16
            for k in range(128):
                block, within = k // 32, k % 32
                d, j = within % 16 // 4, within % 4
                byte = flat[panel * panel_bytes + block * 768 + set_ * 256 + d * 64 + 4 * c + j]
                got = int(byte) & 15 if within < 16 else int(byte) >> 4
                assert got == (int(values[column, k]) if column < 100 else 0), (group, column, k)


@pytest.mark.parametrize("fmt", [QuantFormat(4, 32, has_mins=True), QuantFormat(8, 576), QuantFormat(8, 64)], ids=str)
def test_a_few_rows_with_a_twin_read_the_twin(fmt):
    """The GEMV over the twin (not the one over the codes): a twin whose codes are changed
    changes the product, and the product is the reference's."""
    if not gemm_available() or not kernel_available() or not rounds_inputs():
        pytest.skip("the GEMV over the twin needs AVX-512 VNNI and the bf16 GEMM")
    from fastgen.cpu.native.quantized_linear import _twins

    layer = QuantizedLinear(576, 100, bias=False, dtype=torch.bfloat16)
    tensors = quantize_weight(layer.weight, QuantFormat(fmt.bits, fmt.group_size))
    if fmt.has_mins:
        tensors = tensors._replace(mins=(-tensors.scales.float() * 8).half())
    layer.quantize_(fmt, tensors)
    assert pack_quantized_weights(layer) == 1
    x = torch.randn(3, 576, dtype=torch.bfloat16)
    served = products_served_natively(by_twin_gemv=True)
    before = layer(x)
    assert products_served_natively(by_twin_gemv=True) == served + 1
    weight = dequantize(layer.weight_codes, layer.weight_scales, layer.weight_mins, fmt, torch.bfloat16)
    torch.testing.assert_close(before.float(), F.linear(rounded_rows(x), weight.float()), rtol=1e-2, atol=2e-2)
    _twins[layer.weight_codes.data_ptr()].codes.zero_()
    assert not torch.equal(layer(x), before)
