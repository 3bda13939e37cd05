"""A model's step compiled a group of layers at a time: one compiled group serves every group.

A decoder's layers run the same code, each on its own weights and KV cache. Compiled whole, a
30-layer step made Dynamo, AOTAutograd and Inductor walk 30 copies of one layer: most of a
first compile (about 35 of 47 s for SmolLM2-135M on two cores) grows with the depth. Here the
layers are cut into equal groups (`layers_per_group`: a third of the model or less), and one
graph of a group's layers is compiled and called once per group, each time on that group's
weights and caches; a second, small graph (the final norm, the LM head and the argmax) ends the
step; the embedding lookup runs eagerly before them. Each extra call of a compiled graph costs
tens of microseconds, which is why the groups are few rather than one layer each.

Weights: the compiled steps take the model's weights as one flat buffer per dtype
(`fastgen.cpu.flat_weights`), where every layer's parameters lie in the same order and at the
same stride. A group's weights are then one slice of each buffer, of the same length for every
group, and the group graph forms each weight as a view at the same offset inside any of them
(`GroupedWeights`). Where that does not hold (layers whose shapes or code differ), the groups
are one: the whole stack of layers in one graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fastgen.cpu.flat_weights import ALIGN_BYTES, FlatWeights

# At most this many groups: each is one more call of a compiled graph a step.
MAX_GROUPS = 6


def layers_per_group(num_layers: int, uniform: bool) -> int:
    """How many layers a group holds: the largest divisor of num_layers no more than a third of
    them (three groups or more, so a compile walks a third of the model or less), unless that
    makes more than MAX_GROUPS groups; then, as for layers that are not all alike, all of them."""
    if not uniform:
        return num_layers
    size = max(d for d in range(1, num_layers + 1) if num_layers % d == 0 and d <= math.ceil(num_layers / 3))
    return size if num_layers // size <= MAX_GROUPS else num_layers


@dataclass(frozen=True)
class GroupedWeights:
    """The layers' weights as groups: `groups[g]` is group g's slice of each flat buffer that
    holds layer weights (in `kinds` order), all groups' slices of the same lengths; `layout` places
    each weight of a group's first layer.. last layer inside them, by its name under `LayerGroup`
    (`layers.<i>.<name>`), as `flat_weights.weight_views` reads slots; `head_slots`: the other
    weights (embedding, final norm, LM head), in the flat buffers themselves."""

    size: int  # layers a group
    kinds: tuple[int, ...]  # the flat buffers that hold layer weights
    groups: tuple[tuple[torch.Tensor, ...], ...]
    layout: tuple[tuple[str, int, int, tuple[int, ...]], ...]
    head_slots: tuple[tuple[str, int, int, tuple[int, ...]], ...]


def group_weights(flat: FlatWeights, layers_prefix: str, num_layers: int, size: int) -> GroupedWeights | None:
    """The flat weights cut into groups of `size` layers; None where the layers' weights do not
    lie at one stride with the same shapes (so no one group layout fits every group).
    layers_prefix: the layers' name in the flat weights' names (`model.layers`)."""
    per_layer: list[list[tuple[str, int, int, tuple[int, ...]]]] = [[] for _ in range(num_layers)]
    head_slots = []
    for slot in flat.slots:
        name = slot[0]
        if name.startswith(layers_prefix + "."):
            index, rest = name[len(layers_prefix) + 1:].split(".", 1)
            per_layer[int(index)].append((rest, *slot[1:]))
        else:
            head_slots.append(slot)
    first = per_layer[0]
    kinds = tuple(sorted({kind for _, kind, _, _ in first}))
    base = {kind: min(offset for _, k, offset, _ in first if k == kind) for kind in kinds}
    # A layer's extent in each buffer: to the end of its last weight there, alignment included.
    stride = {}
    for kind in kinds:
        align = max(1, ALIGN_BYTES // flat.buffers[kind].element_size())
        stride[kind] = max(offset + math.ceil(math.prod(shape) / align) * align
                           for _, k, offset, shape in first if k == kind) - base[kind]
    for index, slots in enumerate(per_layer):
        expected = [(rest, kind, offset + index * stride[kind], shape) for rest, kind, offset, shape in first]
        if slots != expected:
            return None
    layout = tuple((f"layers.{i}.{rest}", kinds.index(kind), offset - base[kind] + i * stride[kind], shape)
                   for i in range(size) for rest, kind, offset, shape in first)
    groups = tuple(
        tuple(flat.buffers[kind][base[kind] + g * size * stride[kind]: base[kind] + (g + 1) * size * stride[kind]]
              for kind in kinds)
        for g in range(num_layers // size))
    return GroupedWeights(size, kinds, groups, layout, tuple(head_slots))


class LayerGroup(nn.Module):
    """A model's first `size` layers: what a group graph runs, on any group's weights (swapped in
    by `functional_call`) and caches."""

    def __init__(self, layers: nn.ModuleList, size: int):
        super().__init__()
        self.layers = nn.ModuleList(layers[:size])

    def forward(self, positions, x, residual, meta, kv_caches):
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, meta, kv)
        return x, residual


class StepHead(nn.Module):
    """The end of a step: the final norm, the sampled rows, their logits (named as `StepModel`,
    so that the flat weights' names fit it)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, residual, logits_indices):
        hidden = self.model.final_hidden(x, residual).index_select(0, logits_indices)
        return self.model.compute_logits(hidden)
