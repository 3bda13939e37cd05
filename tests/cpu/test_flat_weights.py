"""A model's weights moved into one flat buffer per dtype (`fastgen.cpu.flat_weights`): every
parameter a view of its buffer with its values kept, tied weights once, each weight aligned, and
the model run on views formed from the buffers (as a compiled step does) equal to the model."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

from fastgen.cpu.flat_weights import ALIGN_BYTES, HUGE_PAGE_BYTES, flatten_weights, weight_views


class Tiny(nn.Module):
    """Two dtypes, a bias, odd sizes (alignment padding) and an embedding tied to the head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(37, 12)
        self.proj = nn.Linear(12, 7)
        self.up = nn.Linear(7, 12, bias=False)
        self.head = nn.Linear(12, 37, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.randn(12, dtype=torch.float64))
        self.register_buffer("offset", torch.randn(12))  # a buffer: stays where it is

    def forward(self, ids):
        x = self.embed(ids)
        x = self.up(torch.relu(self.proj(x))) * self.scale.float() + self.offset
        return self.head(x)


def test_every_parameter_becomes_a_view_of_its_dtypes_buffer_with_its_values():
    torch.manual_seed(0)
    model = Tiny()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    offset_buffer = model.offset
    flat = flatten_weights(model)

    assert sorted(str(b.dtype) for b in flat.buffers) == ["torch.float32", "torch.float64"]
    assert [name for name, *_ in flat.slots] == list(before)  # the tied head once
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])
        kind = next(k for n, k, *_ in flat.slots if n == name)
        buffer = flat.buffers[kind]
        assert p.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert (p.data_ptr() - buffer.data_ptr()) % ALIGN_BYTES == 0
    assert model.head.weight is model.embed.weight
    assert model.offset is offset_buffer


def test_weights_formed_from_the_buffers_run_the_model_as_before():
    torch.manual_seed(0)
    model = Tiny()
    reference = copy.deepcopy(model)
    flat = flatten_weights(model)
    ids = torch.tensor([[1, 5, 36], [0, 2, 9]])
    expected = reference(ids)
    assert torch.equal(model(ids), expected)
    views = weight_views(flat.buffers, flat.slots)
    assert torch.equal(torch.func.functional_call(model, views, (ids,)), expected)
    # The views read the buffers, not copies: a step given other buffers computes with them.
    doubled = tuple(b * 2 for b in flat.buffers)
    with torch.no_grad():
        reference.embed.weight.mul_(2), reference.proj.weight.mul_(2), reference.proj.bias.mul_(2)
        reference.up.weight.mul_(2), reference.scale.mul_(2)
    got = torch.func.functional_call(model, weight_views(doubled, flat.slots), (ids,))
    assert torch.equal(got, reference(ids))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are asked for on Linux hosts")
def test_a_host_buffer_starts_on_a_huge_page_boundary():
    torch.manual_seed(0)
    model = nn.Linear(300, 300)
    reference = copy.deepcopy(model)
    flat = flatten_weights(model)
    assert flat.buffers[0].data_ptr() % HUGE_PAGE_BYTES == 0
    x = torch.randn(2, 300)
    assert torch.equal(model(x), reference(x))


def test_a_model_with_an_empty_parameter_flattens():
    model = Tiny()
    model.empty = nn.Parameter(torch.empty(0, 4, dtype=torch.float16))
    flat = flatten_weights(model)
    assert model.empty.shape == (0, 4) and any(b.dtype == torch.float16 and b.numel() == 0 for b in flat.buffers)
