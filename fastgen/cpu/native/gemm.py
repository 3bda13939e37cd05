"""fastgen's bf16 GEMM for CPUs with AVX-512 BF16 and without AMX (`gemm.cpp`).

On a 2-core AMD EPYC with AVX-512 BF16, the 121 products of one SmolLM2-135M decode step at 32
rows (four a layer and the LM head, each weight cold as in a real step) took 16.3-16.6 ms through
oneDNN over weights it had packed itself, and 12.2-12.3 ms through this kernel; at 512 rows,
188 against 171 ms; at 8 rows, 9.8 against 6.8 ms. The kernel is one register tile (8 rows by
48 columns of fp32 sums) swept over weight panels packed for the dot-product instruction, the
panels streamed in order with software prefetch. Where the CPU has AMX, oneDNN's tile kernels
are left to run instead (`fastgen.cpu.native.packed_linear` chooses).

Its library is built on first use (`fastgen.cpu.native.library`); without a compiler, or on
a CPU without AVX-512 BF16, `gemm_available()` is False and nothing calls it.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from fastgen.cpu.native.library import load_native_library

SOURCE = Path(__file__).with_name("gemm.cpp")


@functools.cache
def _library():
    library = load_native_library(SOURCE)
    if library is None or not library.fastgen_gemm_supported():
        return None
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.fastgen_gemm_packed_size.argtypes = [i64, i64]
    library.fastgen_gemm_packed_size.restype = i64
    library.fastgen_gemm_pack.argtypes = [pointer, pointer, i64, i64, ctypes.c_int]
    library.fastgen_gemm_pack.restype = None
    library.fastgen_gemm.argtypes = [pointer, pointer, pointer, pointer, i64, i64, i64, ctypes.c_int]
    library.fastgen_gemm.restype = ctypes.c_int
    library.fastgen_gemm_quantized.restype = ctypes.c_int
    return library


def gemm_available() -> bool:
    """Whether this machine runs the kernel (building its library now, on first call)."""
    return _library() is not None


@functools.lru_cache(maxsize=None)
def packed_size(n: int, k: int) -> int:
    """Elements of the packed form of an [n, k] weight (cached: checked on every product)."""
    return _library().fastgen_gemm_packed_size(n, k)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's packed form of a bf16 weight [N, K] (a flat bf16 tensor of its own)."""
    library = _library()
    if library is None:
        raise RuntimeError("fastgen's CPU GEMM is not available on this machine")
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"pack_weight takes a 2-d bf16 CPU weight, got {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}")
    weight = weight.contiguous()
    n, k = weight.shape
    packed = torch.empty(packed_size(n, k), dtype=torch.bfloat16)
    library.fastgen_gemm_pack(weight.data_ptr(), packed.data_ptr(), n, k, torch.get_num_threads())
    return packed


def packed_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x bf16 [..., K] and `packed = pack_weight(weight)` (weight
    [n, K], K >= 1); bias: [n] or None."""
    k = x.shape[-1]
    if x.dtype != torch.bfloat16 or k < 1 or packed.numel() != packed_size(n, k):
        raise ValueError(f"packed_gemm: x {x.dtype} [..., {k}] does not fit a weight of {n} rows packed into "
                         f"{packed.numel()} elements")
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()
    status = _library().fastgen_gemm(rows.data_ptr(), packed.data_ptr(), None if bias32 is None else bias32.data_ptr(),
                                     out.data_ptr(), rows.shape[0], n, k, torch.get_num_threads())
    if status != 0:
        raise RuntimeError("fastgen's CPU GEMM has no kernel for this CPU")
    return out
