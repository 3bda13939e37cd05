"""Inductor's C++ kernels cut at the model's layer boundaries, so that every layer's are the same.

Compiling a 30-layer step spent about half its time in the C++ compiler: Inductor's CPU backend
puts consecutive loops into one kernel function until it meets an op it does not generate (a
GEMM, the attention kernel), and the one-row decode graph, whose every op is its own, came out as
two C++ functions of 12,000 lines each. Inductor does compile a kernel once when its source
equals another's, but no two layers' kernels were equal: each read its weights at its own offset
of one flat buffer, and the one-row graph's kernels ran across layers.

Three things make them equal: each layer's weights lie at the same offsets of a buffer of their
own (`fastgen.cpu.flat_weights`); each layer's inputs are made buffers of their own while the step
is traced (`layer_inputs_realized`: left alone, Inductor inlines the residual stream's adds into
their readers, a chain that grows and settles differently from layer to layer); and, while a
graph is compiled, the backend closes the kernel it is writing wherever the layer changes
(`kernels_per_layer`). The loops are the same loops, so the compiled code runs as before; the C++
of a layer is written and compiled once, and the other layers call it over their own buffers.

A node's layer is read from the module stack that Dynamo records on every traced op
(`nn_module_stack`), and AOT autograd and Inductor carry to the nodes they make: "model.layers.7"
and its like. A node made of ops of several layers (a residual add fused into the next layer's
norm, an index every layer shares) counts as the first of them, the same for every layer.

This reaches into Inductor's C++ scheduling (`CppScheduling.codegen_node` and `flush`), which is
not a public interface: where the torch at hand lacks either, compiling goes on as before, one
kernel run across layers (slower to compile, as fast to run).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from torch import nn
from torch._inductor import inductor_prims

# A layer's index in a module path as Dynamo writes it: "getattr(L['m'].model.layers, '7')",
# "L['m'].model.layers[7]" or "model.layers.7".
_LAYER_INDEX = re.compile(r"""layers\W+(\d+)|\bh\W+(\d+)|\[(\d+)\]|'(\d+)'|\.(\d+)\b""")


def layer_of_path(path: str) -> int | None:
    """The layer index in a module path, or None outside the stack of layers."""
    match = _LAYER_INDEX.search(path)
    if match is None:
        return None
    return int(next(group for group in match.groups() if group is not None))


def layers_of_node(node) -> frozenset[int]:
    """The layers the ops of an Inductor scheduler node came from (empty: no layer's). Kept on
    each inner node: the scheduler asks for every pair of nodes it might fuse."""
    layers: set[int] = set()
    for inner in node.get_nodes():
        known = getattr(inner, "_fastgen_layers", None)
        if known is None:
            known = set()
            for origin in getattr(getattr(inner, "node", None), "origins", ()) or ():
                stack = origin.meta.get("nn_module_stack")
                if stack and (layer := layer_of_path(str(next(reversed(stack.values()))[0]))) is not None:
                    known.add(layer)
            known = inner._fastgen_layers = frozenset(known)
        layers |= known
    return frozenset(layers)


def layer_of_node(node) -> int | None:
    """The first layer any op of a scheduler node came from (None: no layer's): a node of ops
    of several layers (an index every layer shares) counts as the first, the same for every layer."""
    layers = layers_of_node(node)
    return min(layers) if layers else None


@contextlib.contextmanager
def kernels_per_layer(fuse_across_layers: bool = False) -> Iterator[bool]:
    """While inside, Inductor's C++ backend ends a kernel where the layer of the nodes it writes
    changes, and unless `fuse_across_layers`, its scheduler fuses no two nodes of different
    layers (it would fuse the same position's RoPE rows of every layer into one loop, in the
    middle of some layer, whose kernels then differ from the others'). Yields whether it could
    (False: this torch's scheduling lacks what it patches)."""
    try:
        from torch._inductor.codegen.cpp import CppScheduling
        from torch._inductor.scheduler import Scheduler
    except ImportError:
        yield False
        return
    codegen_node = getattr(CppScheduling, "codegen_node", None)
    can_fuse = getattr(Scheduler, "can_fuse", None)
    if codegen_node is None or can_fuse is None or not callable(getattr(CppScheduling, "flush", None)):
        yield False
        return

    def can_fuse_within_a_layer(self, node1, node2, *args, **kwargs):
        if len(layers_of_node(node1) | layers_of_node(node2)) > 1:
            return False
        return can_fuse(self, node1, node2, *args, **kwargs)

    def codegen_node_per_layer(self, node):
        layer = layer_of_node(node)
        if getattr(self, "_fastgen_layer", layer) != layer and self.kernel_group.scheduled_nodes:
            self.flush()
        self._fastgen_layer = layer
        return codegen_node(self, node)

    CppScheduling.codegen_node = codegen_node_per_layer
    if not fuse_across_layers:
        Scheduler.can_fuse = can_fuse_within_a_layer
    try:
        yield True
    finally:
        CppScheduling.codegen_node = codegen_node
        Scheduler.can_fuse = can_fuse


def layer_stack(model: nn.Module) -> nn.ModuleList | None:
    """The model's stack of decoder layers: its first list of two or more modules of one type."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1:
            return module
    return None


def _realize_inputs(module: nn.Module, args: tuple) -> tuple:
    return tuple(inductor_prims.force_stride_order(arg, arg.stride())
                 if isinstance(arg, torch.Tensor) and arg.is_floating_point() else arg for arg in args)


@contextlib.contextmanager
def layer_inputs_realized(model: nn.Module) -> Iterator[None]:
    """While inside (a trace), every decoder layer's floating-point tensor arguments (the hidden
    state and the residual stream) pass through `inductor_force_stride_order`, which Inductor
    lowers by storing the value into a buffer of its own (a no-op when it is one already), so each
    layer reads its inputs from buffers, as every other layer does. Eager calls outside see no hook."""
    stack = layer_stack(model)
    handles = [layer.register_forward_pre_hook(_realize_inputs) for layer in stack] if stack is not None else []
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
