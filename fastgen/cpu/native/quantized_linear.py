"""The CPU kernels of `fastgen::quantized_linear` (`quantized_linear_op.cpp`, and for many rows
`fastgen_gemm_quantized` in `gemm.cpp`).

Loading the op's library registers it for the CPU dispatch key, so every quantized product on the
CPU (eager steps and the compiled graphs, which call the op as an extern kernel) runs it instead
of the op's dequantize-then-multiply Python kernel:

- a few rows (the decode steps of a few requests): a GEMV that streams the codes at the memory
  bandwidth (the next channels' codes prefetched). bf16 rows, on a CPU with AVX-512 VNNI, are
  rounded to int8 in blocks of 32 inputs, as llama.cpp rounds its activations, so that codes
  times inputs are integer dot products (`set_rounded_inputs` switches this off); otherwise each
  code is converted to float in registers. Codes with a twin (below) go to a GEMV over the twin,
  a column a vpdpbusd lane (`panel_dot_vnni`);
- more rows (where the GEMV rounds its rows, whose integer products load each chunk of codes
  once for four rows: past 1 MiB of rounded rows, a long prompt's chunk; else from four rows;
  `gemm_rows`), bf16, where the weight has a twin packed by
  `pack_quantized_weights`: the bf16 GEMM's register tile over panels that each thread
  dequantizes one at a time into its cache, so each weight is converted once a call rather than
  once a row.

A twin is the codes again, in panels of 48 output columns, with its scales (and offsets) per
group and panel column in float16: about as large as the codes (1 byte a weight for int8, 0.625
for int4 in groups of 32), in a lanes order that the GEMV over the twin reads and the GEMM
dequantizes (`_lanes_order`, `_lanes_order8`). Like the bf16
weights' packed twins (`fastgen.cpu.native.packed_linear`), they are made for the compiled
steps, where memory allows.

Where a library cannot be built (no compiler) the Python kernel serves every product.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

import fastgen.quantization.ops  # noqa: F401  (the op's schema must exist before a kernel is registered for it)
from fastgen.cpu.native import gemm as cpu_gemm
from fastgen.cpu.native.library import load_native_library, torch_abi_flags
from fastgen.quantization.formats import QuantFormat
from fastgen.quantization.quantize import unpack_codes

SOURCE = Path(__file__).with_name("quantized_linear_op.cpp")
PANEL = 48  # output columns per panel: gemm.cpp's kPanel


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """Build (once per machine) and load the op's kernel, told where the quantized GEMM is; None
    where it cannot be built."""
    library = load_native_library(SOURCE, torch_abi_flags())
    if library is None:
        return None
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.fastgen_quantized_linear_served.restype = i64
    library.fastgen_quantized_linear_served_by_gemm.restype = i64
    library.fastgen_quantized_linear_served_by_twin_gemv.restype = i64
    library.fastgen_quantized_linear_supported.restype = ctypes.c_int
    library.fastgen_quantized_linear_set_gemm.argtypes = [pointer]
    library.fastgen_quantized_linear_add_twin.argtypes = [pointer, pointer, pointer, pointer, i64, i64, i64, i64]
    library.fastgen_quantized_linear_drop_twin.argtypes = [pointer, pointer]
    library.fastgen_quantized_linear_has_rounded_inputs.restype = ctypes.c_int
    library.fastgen_quantized_linear_set_rounded_inputs.argtypes = [ctypes.c_int]
    library.fastgen_quantized_linear_gemm_rows.restype = i64
    library.fastgen_quantized_linear_gemm_rows.argtypes = [i64, i64, i64]
    gemm = cpu_gemm._library()
    if gemm is not None:
        library.fastgen_quantized_linear_set_gemm(ctypes.cast(gemm.fastgen_gemm_quantized, pointer))
    return library


def kernel_available() -> bool:
    """Whether this machine runs the C++ kernels (building them now, on first call)."""
    library = load_kernel()
    return library is not None and bool(library.fastgen_quantized_linear_supported())


def products_served_natively(by_gemm: bool = False, by_twin_gemv: bool = False) -> int:
    """How many quantized products the C++ kernel computed in this process (`by_gemm`: of them,
    through a twin and the GEMM; `by_twin_gemv`: through a twin and the GEMV that reads it);
    0 while it is not loaded (asking does not load it)."""
    if not load_kernel.cache_info().currsize:
        return 0
    library = load_kernel()
    if library is None:
        return 0
    if by_gemm:
        return library.fastgen_quantized_linear_served_by_gemm()
    if by_twin_gemv:
        return library.fastgen_quantized_linear_served_by_twin_gemv()
    return library.fastgen_quantized_linear_served()


def rounds_inputs() -> bool:
    """Whether the GEMV rounds bf16 rows to int8 for integer dot products: where the CPU has
    AVX-512 VNNI, unless `set_rounded_inputs(False)`."""
    library = load_kernel()
    return library is not None and bool(library.fastgen_quantized_linear_has_rounded_inputs())


def gemm_rows(fmt: QuantFormat, in_features: int) -> int | None:
    """From how many bf16 rows a product in `fmt` over `in_features` inputs goes to the GEMM over
    its twin (None where the kernel is not built)."""
    library = load_kernel()
    if library is None:
        return None
    return library.fastgen_quantized_linear_gemm_rows(fmt.bits, fmt.group_size, in_features)


def set_rounded_inputs(on: bool) -> None:
    """Round bf16 rows to int8 in the GEMV where the CPU can (the default), or multiply them as
    they are: tests and benchmarks compare the two."""
    library = load_kernel()
    if library is not None:
        library.fastgen_quantized_linear_set_rounded_inputs(int(on))


class QuantizedTwin(NamedTuple):
    """A quantized weight in the GEMM's panel order (see `fastgen_gemm_quantized`), and the codes
    it was packed from (held, so no other tensor comes to live at their address meanwhile)."""

    codes: torch.Tensor  # uint8: int8 + 128 [panels, K / 32, 3, 8, 16, 4] (`_lanes_order8`); 4-bit
    #                      [panels, K / 32, 3, 4, 16, 4] (`_lanes_order`)
    scales: torch.Tensor  # float16 [panels, groups, 48]
    offsets: torch.Tensor | None  # float16 [panels, groups, 48]: 4-bit, w = code * scale + offset
    source: torch.Tensor


_twins: dict[int, QuantizedTwin] = {}


def _by_panel_column(per_row: torch.Tensor, panels: int) -> torch.Tensor:
    """[N, groups] -> [panels, groups, 48], rows past N zero."""
    padded = per_row.new_zeros(panels * PANEL, per_row.shape[1])
    padded[: per_row.shape[0]] = per_row
    return padded.view(panels, PANEL, -1).transpose(1, 2).contiguous()


def pack_twin(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, fmt: QuantFormat) -> QuantizedTwin:
    """The twin of one quantized weight (its input width a multiple of 32)."""
    values = unpack_codes(codes, fmt)  # [N, K]: int8 codes, or nibbles 0..15
    n, k = values.shape
    panels = -(-n // PANEL)
    padded = values.new_zeros(panels * PANEL, k)
    padded[:n] = values
    if fmt.bits == 8:
        # Unsigned for vpdpbusd: code + 128; the readers take the 128 off as an offset of -128 scale,
        # computed in float32 (in float16 it would overflow for scales past 511.75).
        panel_codes = _lanes_order8(padded.view(torch.uint8) ^ 0x80, panels)
        offsets = None
    else:
        panel_codes = _lanes_order(padded.to(torch.uint8), panels)
        offsets = _by_panel_column(mins if mins is not None else (scales.float() * -8).half(), panels)
    return QuantizedTwin(panel_codes, _by_panel_column(scales, panels), offsets, codes)


def _lanes_order(nibbles: torch.Tensor, panels: int) -> torch.Tensor:
    """4-bit codes [panels * 48, K] (one value 0..15 each) in the twin's order: for each panel and
    block of 32 inputs, its three sets of 16 columns, each four 64-byte vectors whose 32-bit lane c
    holds column c's bytes 4d..4d+3 of the block (byte j: input j in its low nibble, input j + 16
    in its high one). So one vector load gives the GEMV 16 output columns at once, a column a
    lane of vpdpbusd, and the GEMM's dequantizing reads the same bytes (`gemm.cpp`)."""
    k = nibbles.shape[1]
    # [panel, set, column, block, half, d, byte]: input half * 16 + 4 d + byte of the block; the
    # halves share a byte (low, high nibble)
    v = nibbles.view(panels, 3, 16, k // 32, 2, 4, 4)
    return _runs_in_lanes(v[:, :, :, :, 0] | (v[:, :, :, :, 1] << 4))


def _lanes_order8(codes: torch.Tensor, panels: int) -> torch.Tensor:
    """int8 codes made unsigned (code + 128), [panels * 48, K], in the twin's order: for each panel
    and block of 32 inputs, its three sets of 16 columns, each eight 64-byte vectors whose 32-bit
    lane c holds column c's inputs 4d..4d+3 of the block (`_lanes_order`'s, a byte an input)."""
    return _runs_in_lanes(codes.view(panels, 3, 16, codes.shape[1] // 32, 8, 4))


def _runs_in_lanes(runs: torch.Tensor) -> torch.Tensor:
    """[panel, set, column, block, d, byte] -> [panel, block, set, d, column, byte]: a run's 4
    bytes of 16 columns side by side, one 64-byte vector."""
    return runs.permute(0, 3, 1, 4, 2, 5).contiguous()


def _forget(key: int, twin: QuantizedTwin) -> None:
    if _twins.get(key) is twin:
        del _twins[key]
    if (library := load_kernel()) is not None:
        library.fastgen_quantized_linear_drop_twin(key, twin.codes.data_ptr())


def twin_layers(model: nn.Module) -> list[nn.Module]:
    """The quantized linear layers of `model` (`fastgen.layers.quantizable`) whose products the
    GEMM can serve: on the CPU, bf16 activations, groups a multiple of 32 (what the op's kernel
    takes); each matrix once (a tied LM head shares its embedding's codes; an embedding itself
    only looks rows up)."""
    seen: set[int] = set()
    layers = []
    for module in model.modules():
        fmt = getattr(module, "quant_format", None)
        if (fmt is None or not isinstance(module, nn.Linear) or id(module.weight_codes) in seen
                or module.weight_codes.device.type != "cpu" or module.activation_dtype != torch.bfloat16
                or fmt.group_size % 32):
            continue
        seen.add(id(module.weight_codes))
        layers.append(module)
    return layers


def twin_bytes(model: nn.Module) -> int:
    """Bytes the twins of `model`'s quantized weights take (what `pack_quantized_weights`
    allocates)."""
    total = 0
    for module in twin_layers(model):
        n, groups = module.weight_scales.shape
        k = module.weight_codes.shape[1] * (2 if module.quant_format.bits == 4 else 1)
        panels = -(-n // PANEL)
        total += panels * PANEL * k * module.quant_format.bits // 8
        total += panels * PANEL * groups * 2 * (1 if module.quant_format.bits == 8 else 2)  # scales (and offsets)
    return total


def pack_quantized_weights(model: nn.Module) -> int:
    """Give each quantized weight of `twin_layers(model)` a twin for the GEMM, once; returns how
    many have one. Nothing where the kernels are not built (nor built for a model with no such
    layer: a bf16 engine's first compile would pay for it on a core the compile wants)."""
    layers = twin_layers(model)
    if not layers:
        return 0
    library = load_kernel()
    if library is None or cpu_gemm._library() is None:
        return 0
    count = 0
    for module in layers:
        codes, fmt = module.weight_codes, module.quant_format
        key = codes.data_ptr()
        if key not in _twins:
            with torch.no_grad():
                twin = pack_twin(codes.detach(), module.weight_scales.detach(),
                                 None if module.weight_mins is None else module.weight_mins.detach(), fmt)
            _twins[key] = twin
            weakref.finalize(codes, _forget, key, twin)
            k = codes.shape[1] * (2 if fmt.bits == 4 else 1)
            library.fastgen_quantized_linear_add_twin(
                key, twin.codes.data_ptr(), twin.scales.data_ptr(),
                None if twin.offsets is None else twin.offsets.data_ptr(), codes.shape[0], k, fmt.bits, fmt.group_size)
        count += 1
    return count
