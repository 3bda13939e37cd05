"""Linear layers over weights laid out once for oneDNN, for the many-row CPU graphs.

oneDNN's bf16 GEMM computes from a blocked weight layout. Given a plain [N, K] weight it reorders
the whole weight into that layout on every call: at 32 rows that pass costs about as much as the
product. One 32-row decode step of SmolLM2-135M (121 products: four a layer and the LM head,
weights cold as in a real step, 2 cores) took 21.6 ms with plain weights and 16.6 ms with weights
reordered beforehand (`mkldnn._reorder_linear_weight`, then `mkldnn._linear_pointwise`), with the
same results bit for bit. Inductor cannot take such an opaque oneDNN tensor as a graph input, so the
graphs call `fastgen::packed_linear` instead of `F.linear` (`linears_as_packed`, the counterpart
of `fastgen.compile.gemv` for many rows): the op receives the plain weight, which the graph holds
like any parameter, and looks up its packed twin here. A weight with no twin (not packed, another
dtype) goes through `F.linear`, so a saved graph runs the same either way.

The cost is memory: the packed twins are a second copy of every linear weight (269 MB for
SmolLM2-135M in bf16). The one-row graph keeps reading the plain weights, which its reductions
stream faster than a GEMM does. Only bf16 weights are packed: in float32, torch's own GEMM is not
oneDNN's, so its results would change.
"""

from __future__ import annotations

import weakref

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from fastgen.compile.gemv import LINEAR_CALLS
from fastgen.cpu_features import has_native_bf16

# Packed twins by the plain weight's identity (address, shape, strides). An entry leaves with its
# weight (a finalizer), so a later model whose weight reuses the address never meets a stale twin.
_twins: dict[tuple, torch.Tensor] = {}


def _identity(weight: torch.Tensor) -> tuple:
    return weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype


def packable_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights `pack_linear_weights` would pack: every bf16 linear weight on the CPU, where
    the CPU computes bf16 natively (elsewhere oneDNN has no bf16 GEMM worth packing for, and
    may refuse to reorder)."""
    if not has_native_bf16():
        return []
    return [module.weight for module in model.modules()
            if isinstance(module, nn.Linear) and module.weight.dtype == torch.bfloat16
            and module.weight.device.type == "cpu" and module.weight.dim() == 2]


def pack_linear_weights(model: nn.Module) -> int:
    """Give every weight of `packable_weights(model)` a packed twin (once per weight); returns
    how many have one. Weights must not change afterwards."""
    weights = packable_weights(model)
    for weight in weights:
        key = _identity(weight)
        if key not in _twins:
            with torch.no_grad():
                _twins[key] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            weakref.finalize(weight, _twins.pop, key, None)
    return len(weights)


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("fastgen::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through weight's packed twin where it has one."""
    packed = _twins.get(_identity(weight))
    if packed is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return _packed_product(x.contiguous(), packed, bias)


@packed_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linears_as_packed(gm: torch.fx.GraphModule) -> int:
    """Rewrite every bf16 linear call of a Dynamo graph into `fastgen::packed_linear`, in place;
    returns how many. Others stay Inductor's own GEMMs: no twin would ever serve them."""
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in LINEAR_CALLS:
            continue
        args = dict(zip(("input", "weight", "bias"), node.args), **node.kwargs)
        weight = args["weight"].meta.get("example_value") if isinstance(args["weight"], torch.fx.Node) else None
        if weight is not None and weight.dtype != torch.bfloat16:
            continue
        node.args, node.kwargs = (args["input"], args["weight"], args.get("bias")), {}
        node.target = torch.ops.fastgen.packed_linear.default
        count += 1
    gm.recompile()
    return count
