"""Weights that may be quantized: the products and lookups of fastgen's linear and embedding layers.

A layer with this mixin computes through `product` (a linear layer) or `lookup` (an embedding):
`F.linear` / `F.embedding` over its `weight`, or, once `quantize_` replaced that weight by
codes and scales (`fastgen.quantization.formats`), the quantized op over those. The codes,
scales and minimums are parameters (`weight_codes`, `weight_scales`, `weight_mins`), so every
path that walks a model's parameters (the flat weight buffers of the compiled CPU steps, tensor
parallel loading, `named_parameters` deduplicating a tied matrix) sees them as it saw `weight`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastgen.quantization.formats import QuantFormat
from fastgen.quantization.ops import quantized_embedding, quantized_linear
from fastgen.quantization.quantize import QuantizedTensors, quantize_weight

# On CUDA, products of a few rows (decode at batch 1 and 2 by default) in a float dtype go to
# fastgen's Triton kernel that streams the weight (`fastgen.kernels.skinny_matmul`): on an H100 it beat
# cuBLAS on every projection of Qwen3-0.6B there, and lost from four rows on. A switch so that
# benchmarks can compare the two (`benchmarks/gpu_decode.py --dense-products cublas`).
SKINNY_MATMUL_ON_CUDA = True
# The same products behind an RMSNorm (q|k|v, gate|up) take the norm into the product's launch,
# and gate|up its SwiGLU too (`fastgen.kernels.normed_skinny_matmul`): two launches a layer
# where there were five. A switch for the same comparison (`--fused-norms off`).
RMS_NORM_IN_PRODUCTS_ON_CUDA = True
# The most rows those two kernels take (at most the kernels' SKINNY_ROWS, 8); more go to cuBLAS.
# Read at each call. The product alone loses to cuBLAS from four rows on, but a step past this
# limit also loses the norms fused into its products and its products' programmatic launches
# (on an H200 a step of three rows took half as long again as one of two, and about as long as
# one of eight). `benchmarks/gpu_decode.py --skinny-max-rows` times the whole step with others.
SKINNY_MAX_ROWS_ON_CUDA = 2
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _skinny_matmul():
    from fastgen.kernels.skinny_matmul import skinny_matmul  # Triton: imported where a GPU runs it

    return skinny_matmul


def _skinny_on_cuda(x: torch.Tensor, weight: torch.Tensor) -> bool:
    k = x.shape[-1]
    return (x.is_cuda and SKINNY_MATMUL_ON_CUDA and 0 < k and x.numel() <= SKINNY_MAX_ROWS_ON_CUDA * k
            and x.dtype in _FLOAT_DTYPES and weight.dtype == x.dtype)


def _normed_skinny_matmul():
    from fastgen.kernels.normed_skinny_matmul import normed_skinny_matmul

    return normed_skinny_matmul


def _normed_on_cuda(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not (RMS_NORM_IN_PRODUCTS_ON_CUDA and _skinny_on_cuda(x, weight)):
        return False
    from fastgen.kernels.normed_skinny_matmul import MAX_NORMED_K

    return x.shape[-1] <= MAX_NORMED_K


def _frozen(tensor: torch.Tensor | None) -> nn.Parameter | None:
    return None if tensor is None else nn.Parameter(tensor, requires_grad=False)


class QuantizableWeight:
    """Mixin for nn.Linear / nn.Embedding subclasses (see the module's docstring)."""

    quant_format: QuantFormat | None = None
    # The dtype of the weight quantized away, and of the outputs, kept by name: a torch.dtype in a
    # module's attributes that a compiled graph never reads is pickled as missing in the graph's
    # saved guards, and with it every tensor of that dtype, so the package no longer loads.
    activation_dtype_name: str | None = None

    @property
    def activation_dtype(self) -> torch.dtype | None:
        return None if self.activation_dtype_name is None else getattr(torch, self.activation_dtype_name)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] times the weight's transpose, plus `bias`: [..., out]."""
        fmt = self.quant_format
        if fmt is None:
            if _skinny_on_cuda(x, self.weight):
                return _skinny_matmul()(x, self.weight, bias)
            return F.linear(x, self.weight, bias)
        return quantized_linear(x, self.weight_codes, self.weight_scales, self.weight_mins, bias, fmt.bits,
                                fmt.group_size)

    def rms_norm_product(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                         eps: float, bias: torch.Tensor | None, swiglu: bool):
        """(y, h) with h = x + residual (x without one) and y this product of rms_norm(h) *
        norm_weight plus `bias`, then SwiGLU of its two halves with `swiglu`, from one launch:
        on CUDA for up to `SKINNY_MAX_ROWS_ON_CUDA` rows of a float weight. None where that
        kernel does not apply (the caller runs the ops in turn)."""
        if self.quant_format is not None or not _normed_on_cuda(x, self.weight):
            return None
        if norm_weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
            return None
        return _normed_skinny_matmul()(x, residual, norm_weight, eps, self.weight, bias, swiglu)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids`: [*ids.shape, hidden]."""
        fmt = self.quant_format
        if fmt is None:
            return F.embedding(ids, self.weight)
        return quantized_embedding(ids, self.weight_codes, self.weight_scales, self.weight_mins, fmt,
                                   self.activation_dtype)

    def quantize_(self, fmt: QuantFormat, tensors: QuantizedTensors | None = None) -> None:
        """Replace `weight` by its quantized form in `fmt` (computed here unless `tensors` brings
        it, e.g. read from a GGUF file)."""
        assert self.quant_format is None, "quantized twice"
        dtype = self.weight.dtype
        if tensors is None:
            tensors = quantize_weight(self.weight, fmt)
        self._replace_weight(fmt, dtype, *(_frozen(t) for t in tensors))

    def share_quantized_(self, other: QuantizableWeight) -> None:
        """Hold `other`'s quantized weight (a tied LM head and embedding)."""
        self._replace_weight(other.quant_format, other.activation_dtype, other.weight_codes, other.weight_scales,
                             other.weight_mins)

    def _replace_weight(self, fmt, dtype, codes, scales, mins) -> None:
        del self.weight
        self.weight_codes, self.weight_scales = codes, scales
        self.register_parameter("weight_mins", mins)
        self.quant_format, self.activation_dtype_name = fmt, str(dtype).removeprefix("torch.")
