"""A compiled step's C++ kernels cut at its layers (`fastgen.cpu.layer_kernels`), with each layer's
weights at the same offsets of a buffer of its own (`fastgen.cpu.flat_weights`): every middle layer
calls the same kernels, so the code Inductor writes and compiles stops growing with depth, and the
graph computes what the eager model does."""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch
from torch import nn

from fastgen.cpu.flat_weights import ALIGN_BYTES, flatten_weights, weight_group, weight_views
from fastgen.cpu.layer_kernels import kernels_per_layer, layer_inputs_realized, layer_of_path, layer_stack


@pytest.mark.parametrize(("path", "layer"), [
    ("getattr(L['step_model'].model.layers, '7').self_attn", 7),
    ("L['step_model'].model.layers[12].mlp", 12),
    ("model.layers.3.mlp.down_proj", 3),
    ("getattr(L['step_model'].transformer.h, '4').attn", 4),
    ("L['step_model'].model.embed_tokens", None),
    ("L['step_model'].model.norm", None),
])
def test_a_module_path_names_its_layer(path, layer):
    assert layer_of_path(path) == layer


class Block(nn.Module):
    """A decoder layer's shape of work: a residual add and a norm, then products written as
    reductions (as the one-row graph's linears are) and a gated activation."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.Parameter(torch.rand(width) + 0.5)
        self.up = nn.Parameter(torch.randn(2 * width, width) / math.sqrt(width))
        self.down = nn.Parameter(torch.randn(width, width) / math.sqrt(width))

    def forward(self, x, residual):
        residual = x if residual is None else x + residual
        h = residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        gate, up = (h.unsqueeze(-2) * self.up).sum(-1).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up).unsqueeze(-2).mul(self.down).sum(-1), residual


class Stack(nn.Module):
    def __init__(self, depth: int, width: int = 64):
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Parameter(torch.randn(16, width))

    def forward(self, x):
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual)
        return (x + residual) @ self.head.t()


def compile_and_record(depth: int, per_layer: bool) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Stack(depth) compiled as the CPU steps are (flat weights formed inside, Inductor's C++
    wrapper); returns the kernel of every kernel call Inductor wrote, the graph's output and eager's."""
    from torch._inductor import config
    from torch._inductor.codegen.cpp import CppScheduling
    from torch._inductor.compile_fx import compile_fx

    torch.manual_seed(depth)
    model = Stack(depth)
    flat = flatten_weights(model)
    x = torch.randn(3, 64)
    want = model(x)

    def step(buffers, x):
        return torch.func.functional_call(model, weight_views(buffers, flat.slots), (x,))

    calls: list[str] = []
    define_kernel = CppScheduling.define_kernel

    def recording(self, *args, **kwargs):
        calls.append(name := define_kernel(self, *args, **kwargs))
        return name

    def backend(gm, example_inputs):
        cut = kernels_per_layer() if per_layer else nullcontext()
        with config.patch(cpp_wrapper=True, fx_graph_cache=False), cut:
            return compile_fx(gm, example_inputs)


    torch._dynamo.reset()
    CppScheduling.define_kernel = recording
    try:
        with layer_inputs_realized(model) if per_layer else nullcontext():
            compiled = torch.compile(step, backend=backend, fullgraph=True)
            got = compiled(flat.buffers, x)
    finally:
        CppScheduling.define_kernel = define_kernel
        torch._dynamo.reset()
    return calls, got, want


def test_every_middle_layer_calls_the_same_kernels():
    shallow, got, want = compile_and_record(4, per_layer=True)
    torch.testing.assert_close(got, want)
    deep, got, want = compile_and_record(7, per_layer=True)
    torch.testing.assert_close(got, want)
    assert len(deep) > len(shallow) >= 4  # a kernel call (at least) a layer
    assert len(set(deep)) == len(set(shallow)) < len(shallow)  # three more layers, no new kernel
    # Without the cut Inductor runs the layers' loops together, in fewer kernels than layers.
    plain, got, want = compile_and_record(7, per_layer=False)
    torch.testing.assert_close(got, want)
    assert len(plain) < 7


def test_each_layers_weights_lie_at_the_same_offsets_of_a_buffer_of_their_own():
    model = Stack(3)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    flat = flatten_weights(model)
    groups = {weight_group(name) for name, *_ in flat.slots}
    assert groups == {"", "layers.0", "layers.1", "layers.2"} and len(flat.buffers) == 4
    places = {name: (index, offset) for name, index, offset, _ in flat.slots}
    for part in ("norm", "up", "down"):
        offsets = {places[f"layers.{i}.{part}"][1] for i in range(3)}
        buffers = {places[f"layers.{i}.{part}"][0] for i in range(3)}
        assert len(offsets) == 1 and len(buffers) == 3
    # One allocation for the dtype, each layer's buffer an aligned slice of it; values kept.
    assert len({b.untyped_storage().data_ptr() for b in flat.buffers}) == 1
    assert all(b.data_ptr() % ALIGN_BYTES == 0 for b in flat.buffers)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])


def test_the_hooks_that_realize_layer_inputs_leave_with_the_trace():
    model = Stack(3)
    assert layer_stack(model) is model.layers
    with layer_inputs_realized(model):
        assert all(len(layer._forward_pre_hooks) == 1 for layer in model.layers)
        x = torch.randn(2, 64)
        torch.testing.assert_close(model(x), model(x))
    assert all(not layer._forward_pre_hooks for layer in model.layers)
