"""The eager op set computes GPT-2's LayerNorm and GELU bit for bit as transformers does, so
greedy parity rests on the same arithmetic (the compiled twins are checked against these in
test_compiled_ops.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.activations import ACT2FN

from fastgen.compile import build_op_set


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_is_transformers_gelu_new(dtype):
    x = (torch.randn(7, 96, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    assert torch.equal(build_op_set(False).gelu_tanh(x), ACT2FN["gelu_new"](x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_and_add_layer_norm_are_nn_layer_norm(dtype):
    g = torch.Generator().manual_seed(1)
    x, residual = torch.randn(5, 64, generator=g).to(dtype), torch.randn(5, 64, generator=g).to(dtype)
    norm = nn.LayerNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
        norm.bias.copy_(torch.randn(64, generator=g))
        ops = build_op_set(False)
        assert torch.equal(ops.layer_norm(x, norm.weight, norm.bias, 1e-5), norm(x))
        normed, summed = ops.add_layer_norm(x, residual, norm.weight, norm.bias, 1e-5)
        assert torch.equal(summed, x + residual) and torch.equal(normed, norm(x + residual))
