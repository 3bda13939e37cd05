"""Linear layers over weights laid out once for a CPU GEMM kernel, for the compiled CPU steps.

A bf16 GEMM computes from a weight layout of its own. oneDNN, given a plain [N, K] weight, reorders
the whole weight into its layout on every call: at 32 rows that pass costs about as much as the
product. One 32-row decode step of SmolLM2-135M (121 products: four a layer and the LM head,
weights cold as in a real step, 2 cores of an AMD EPYC with AVX-512 BF16) took 21.6 ms with plain
weights, 16.6 ms through oneDNN over weights it had reordered beforehand
(`mkldnn._reorder_linear_weight`, then `mkldnn._linear_pointwise`), and 12.2 ms through fastgen's
own kernel over weights packed for it (`fastgen.cpu.native.gemm`). So each bf16 linear weight gets
a packed twin once: fastgen's layout where that kernel runs and the CPU has no AMX (whose tile
kernels oneDNN uses), else oneDNN's.

Inductor cannot take such a packed tensor as a graph input (an opaque oneDNN tensor raised a
LoweringException), so the graphs call `fastgen::packed_linear` instead of `F.linear`
(`linears_as_packed`): the op receives
the plain weight, which the graph holds like any parameter, and looks up its twin here. A weight
with no twin (not packed, another dtype) goes through `F.linear`, so a saved graph runs the same
either way.

The cost is memory: the twins are a second copy of every linear weight (269 MB for SmolLM2-135M
in bf16).
Only bf16 weights are packed: in float32, torch's own GEMM is neither kernel, so results would
change. oneDNN's products equal F.linear's bit for bit; fastgen's sum the same products in the
same order and matched F.linear in all but a few outputs in ten thousand.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from pathlib import Path
from typing import NamedTuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from fastgen.cpu.native import gemm as cpu_gemm
from fastgen.cpu.native.features import cpu_flags, has_native_bf16
from fastgen.cpu.native.library import load_native_library, torch_abi_flags


class Twin(NamedTuple):
    """A weight packed for `kernel`: "fastgen" (`fastgen.cpu.native.gemm`) or "onednn", and the
    weight it was packed from (`source`: its shape and strides are checked at lookup, and it
    holds the memory, so no other weight can come to live at the address while the entry lives,
    even if the parameter's data is replaced meanwhile)."""

    kernel: str
    packed: torch.Tensor
    source: torch.Tensor


OP_SOURCE = Path(__file__).with_name("packed_linear_op.cpp")

# How a linear layer's call appears in a Dynamo graph (what `linears_as_packed` rewrites).
LINEAR_CALLS = {torch._C._nn.linear, torch.nn.functional.linear}

# Packed twins by the plain weight's address (checked against its shape and strides at lookup:
# one dict read, about 0.3 us, where a tuple key of all four cost 2 us on every product). An
# entry leaves with its weight's parameter (a finalizer).
_twins: dict[int, Twin] = {}


def _twin_of(weight: torch.Tensor) -> Twin | None:
    twin = _twins.get(weight.data_ptr())
    if (twin is None or twin.source.shape != weight.shape or twin.source.stride() != weight.stride()
            or weight.dtype != torch.bfloat16):
        return None
    return twin


def _forget(key: int, twin: Twin) -> None:
    if _twins.get(key) is twin:  # not a later weight's twin at the same address
        del _twins[key]
    # The C++ kernel's entry goes in any case (it checks it is this twin's): its packed memory
    # goes with this twin, even where a later twin replaced it here.
    if twin.kernel == "fastgen" and (library := _loaded_native_kernel()) is not None:
        library.fastgen_packed_linear_drop_twin(key, twin.packed.data_ptr())


@functools.cache
def _native_kernel():
    """The op's C++ CPU kernel (`packed_linear_op.cpp`, loading it registers it), told where
    fastgen's GEMM is; None where either cannot be built. The Python kernel below serves then."""
    gemm = cpu_gemm._library()
    library = load_native_library(OP_SOURCE, torch_abi_flags()) if gemm is not None else None
    if library is None:
        return None
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.fastgen_packed_linear_set_gemm.argtypes = [pointer]
    library.fastgen_packed_linear_add_twin.argtypes = [pointer, pointer, i64, i64, i64, i64]
    library.fastgen_packed_linear_drop_twin.argtypes = [pointer, pointer]
    library.fastgen_packed_linear_served.restype = i64
    library.fastgen_packed_linear_set_gemm(ctypes.cast(gemm.fastgen_gemm, pointer))
    return library


def _loaded_native_kernel():
    """`_native_kernel()` if it was already asked for, else None (without loading it)."""
    return _native_kernel() if _native_kernel.cache_info().currsize else None


def packable_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights `pack_linear_weights` would pack: every bf16 linear weight on the CPU, where
    the CPU computes bf16 natively (elsewhere neither kernel has a bf16 GEMM worth packing for,
    and oneDNN may refuse to reorder)."""
    if not has_native_bf16():
        return []
    weights = (getattr(module, "weight", None) for module in model.modules() if isinstance(module, nn.Linear))
    # (a quantized layer has no `weight`: its codes go through `fastgen::quantized_linear`)
    return [weight for weight in weights
            if weight is not None and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.dim() == 2]


def packing_kernel() -> str:
    """The kernel twins are packed for here: fastgen's where it runs and the CPU has no AMX,
    else oneDNN's."""
    return "fastgen" if cpu_gemm.gemm_available() and "amx_bf16" not in cpu_flags() else "onednn"


def pack_linear_weights(model: nn.Module, kernel: str | None = None) -> int:
    """Give every weight of `packable_weights(model)` a packed twin for `kernel` (default:
    `packing_kernel()`), once per weight; returns how many have one. Weights must not change
    afterwards."""
    weights = packable_weights(model)
    kernel = kernel or packing_kernel()
    for weight in weights:
        if _twin_of(weight) is None:
            with torch.no_grad():
                packed = cpu_gemm.pack_weight(weight.detach()) if kernel == "fastgen" \
                    else torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            key = weight.data_ptr()
            twin = _twins[key] = Twin(kernel, packed, weight.detach())
            weakref.finalize(weight, _forget, key, twin)
            if kernel == "fastgen" and (library := _native_kernel()) is not None:
                library.fastgen_packed_linear_add_twin(key, packed.data_ptr(), *weight.shape, *weight.stride())
    return len(weights)


def _packed_product(x: torch.Tensor, twin: Twin, bias: torch.Tensor | None) -> torch.Tensor:
    if twin.kernel == "fastgen":
        return cpu_gemm.packed_gemm(x, twin.packed, twin.source.shape[0], bias)
    return torch.ops.mkldnn._linear_pointwise(x, twin.packed, bias, "none", [], "")


def _through_twin(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    twin = _twin_of(weight)
    if twin is None or x.dtype != weight.dtype or x.shape[-1] != weight.shape[1] or 0 in weight.shape:
        return F.linear(x, weight, bias)  # (which also reports a shape mismatch)
    return _packed_product(x.contiguous(), twin, bias)


@torch.library.custom_op("fastgen::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through weight's packed twin where it has one. On the CPU, once
    fastgen's GEMM has packed a twin, the C++ kernel (`packed_linear_op.cpp`) serves this op."""
    return _through_twin(x, weight, bias)


@torch.library.custom_op("fastgen::packed_linear_fallback", mutates_args=())
def packed_linear_fallback(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """This Python kernel of `packed_linear` under a name of its own: what the C++ kernel calls
    for a product it cannot serve itself (a oneDNN twin, no twin, an unusual input)."""
    return _through_twin(x, weight, bias)


@packed_linear.register_fake
@packed_linear_fallback.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def products_served_natively() -> int:
    """How many products the C++ kernel has computed over fastgen twins in this process (0
    while it is not loaded; asking does not load it)."""
    library = _loaded_native_kernel()
    return 0 if library is None else library.fastgen_packed_linear_served()


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
