"""The quantized products the layers call: `fastgen::quantized_linear` and the embedding lookup.

`quantized_linear` is an op of its own (not a torch expression) so that each place that runs it
can choose its kernel: on the CPU fastgen's C++ kernels (`fastgen.cpu.native.quantized_linear`
registers them), on CUDA the Triton kernel (`fastgen.kernels.quantized_matmul`); elsewhere, and
where those cannot serve a call, its own kernel below dequantizes the weight and multiplies,
exact but not fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastgen.quantization.formats import QuantFormat
from fastgen.quantization.quantize import dequantize


@torch.library.custom_op("fastgen::quantized_linear", mutates_args=())
def quantized_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                     bias: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """F.linear(x, dequantize(codes, scales, mins), bias) for x [..., K] (see
    `fastgen.quantization.formats` for the layout)."""
    return _dequantize_and_multiply(x, codes, scales, mins, bias, bits, group_size)


def _dequantize_and_multiply(x, codes, scales, mins, bias, bits, group_size):
    weight = dequantize(codes, scales, mins, QuantFormat(bits, group_size, mins is not None), x.dtype)
    return F.linear(x, weight, bias)


@torch.library.custom_op("fastgen::quantized_linear_reference", mutates_args=())
def quantized_linear_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                               bias: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """`quantized_linear`'s Python kernel under a name of its own: what a native kernel of that op
    (`fastgen.cpu.native.quantized_linear`) calls for a product it cannot serve."""
    return _dequantize_and_multiply(x, codes, scales, mins, bias, bits, group_size)


@quantized_linear.register_kernel("cuda")
def _triton_kernel(x, codes, scales, mins, bias, bits, group_size):
    """On CUDA: fastgen's Triton kernel, dequantizing in registers (`fastgen.kernels.quantized_matmul`)."""
    from fastgen.kernels.quantized_matmul import quantized_matmul  # Triton: imported where a GPU runs it

    return quantized_matmul(x, codes, scales, mins, bias, bits, group_size)


@quantized_linear.register_fake
@quantized_linear_reference.register_fake
def _(x, codes, scales, mins, bias, bits, group_size):
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


def quantized_embedding(ids: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                        fmt: QuantFormat, dtype: torch.dtype) -> torch.Tensor:
    """The rows `ids` of a quantized [vocab, hidden] matrix, dequantized: [*ids.shape, hidden]."""
    flat = ids.reshape(-1)
    rows = dequantize(codes.index_select(0, flat), scales.index_select(0, flat),
                      None if mins is None else mins.index_select(0, flat), fmt, dtype)
    return rows.reshape(*ids.shape, rows.shape[-1])
