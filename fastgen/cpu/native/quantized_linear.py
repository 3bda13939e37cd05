"""The CPU kernel of `fastgen::quantized_linear` (`quantized_linear_op.cpp`).

Loading the library registers it for the CPU dispatch key, so every quantized product on the
CPU (eager steps and the compiled graphs, which call the op as an extern kernel) runs it instead
of the op's dequantize-then-multiply Python kernel. At one row it streams the codes: the
quantized step's time is the bytes it reads, not the conversions.

Where the library cannot be built (no compiler) the Python kernel serves every product.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import fastgen.quantization.ops  # noqa: F401  (the op's schema must exist before a kernel is registered for it)
from fastgen.cpu.native.library import load_native_library, torch_abi_flags

SOURCE = Path(__file__).with_name("quantized_linear_op.cpp")


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """Build (once per machine) and load the kernel; None where it cannot be."""
    library = load_native_library(SOURCE, torch_abi_flags())
    if library is not None:
        library.fastgen_quantized_linear_served.restype = ctypes.c_int64
    return library


def products_served_natively() -> int:
    """How many quantized products the C++ kernel computed in this process (0 while it is not
    loaded; asking does not load it)."""
    if not load_kernel.cache_info().currsize:
        return 0
    library = load_kernel()
    return 0 if library is None else library.fastgen_quantized_linear_served()
