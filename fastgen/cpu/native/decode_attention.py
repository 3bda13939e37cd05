"""The CPU paged decode attention kernel (`decode_attention.cpp`) as a torch op.

`torch.ops.fastgen.paged_decode_attention_cpu` reads each sequence's K/V in place through its
block table, so the compiled CPU decode step (`fastgen.cpu.compiled_decode`) calls it like any
other op and its saved graphs hold no reference to the library. At batch 32 on SmolLM2-135M's
shapes (bf16, 2 threads, each layer's cache cold as in a real step) it took 0.165-0.173 ms a layer
where the gather and two bmm's of `fastgen.cpu.native.torch_decode` took 0.45-0.50 ms: that path
writes every context into a copy padded to the longest one and reads it back.

The library is built on first use (about a second, `fastgen.cpu.native.library`). Where it
cannot be built the op runs the torch path instead, so a graph saved on one machine still runs on
another without a compiler.
"""

import ctypes
import functools
from pathlib import Path

import torch

from fastgen.cpu.native.library import load_native_library, torch_abi_flags
from fastgen.cpu.native.torch_decode import build_decode_kv_index, decode_attention

SOURCE = Path(__file__).with_name("decode_attention.cpp")
OP_SOURCE = Path(__file__).with_name("decode_attention_op.cpp")
HEAD_DIMS = (16, 32, 64, 128, 256)  # the kernel's compiled instances
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def kernel_supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors: on a CPU, float32 or bfloat16 throughout,
    contiguous caches, a compiled head dim, and whole groups of query heads per KV head. Says
    nothing about whether the library builds (the op falls back by itself)."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    return (q.device.type == "cpu" and q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in _DTYPE_CODES
            and k_cache.is_contiguous() and v_cache.is_contiguous() and head_dim in HEAD_DIMS
            and heads % kv_heads == 0)


def kernel_built() -> bool:
    """Whether the kernel's library is built on this machine (building it now, on first call).
    Decode runs the op either way (it falls back by itself); prefill asks first, since the
    fallback would gather every token's whole context, quadratic in the prompt's length."""
    return _entry_point() is not None


@functools.cache
def _entry_point():
    library = load_native_library(SOURCE)
    if library is None:
        return None
    entry = library.fastgen_paged_decode_attention
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    entry.argtypes = [ctypes.c_int, pointer, i64, i64, pointer, pointer, pointer, i64, pointer, pointer,
                      i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    entry.restype = ctypes.c_int
    op_library = load_native_library(OP_SOURCE, torch_abi_flags())  # registers the op's C++ kernel
    if op_library is not None:
        op_library.fastgen_decode_attention_op_served.restype = ctypes.c_int64
        op_library.fastgen_decode_attention_op_set_entry.argtypes = [ctypes.c_void_p]
        op_library.fastgen_decode_attention_op_set_entry(ctypes.cast(entry, ctypes.c_void_p))
    _op_library.append(op_library)
    return entry


_op_library: list = []  # the op's C++ kernel's library, once `_entry_point` loaded it (None: not built)


def calls_served_in_cpp() -> int:
    """How many of the op's calls its C++ kernel computed in this process (0 before the kernel's
    library is loaded)."""
    library = _op_library[0] if _op_library else None
    return 0 if library is None else library.fastgen_decode_attention_op_served()


@torch.library.custom_op("fastgen::paged_decode_attention_cpu", mutates_args=())
def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D] (last dim contiguous); k_cache, v_cache [blocks, block_size, KV, D], contiguous;
    block_tables int32 [B, W]; context_lens int32 [B], 0 for a padding row (output 0).
    Returns [B, H, D] in q's dtype. Only for shapes `kernel_supports` accepts. Once the kernel's
    library is loaded, the op's CPU calls go to `decode_attention_op.cpp` (the same kernel, called
    from C++), and this Python implementation serves only what that cannot."""
    return _attend(q, k_cache, v_cache, block_tables, context_lens, scale)


@torch.library.custom_op("fastgen::paged_decode_attention_cpu_reference", mutates_args=())
def paged_decode_attention_cpu_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                                         scale: float) -> torch.Tensor:
    """The op's Python implementation under a name of its own: what its C++ kernel calls for
    inputs it cannot serve."""
    return _attend(q, k_cache, v_cache, block_tables, context_lens, scale)


def _attend(q, k_cache, v_cache, block_tables, context_lens, scale):
    if not (q.dtype == k_cache.dtype == v_cache.dtype and k_cache.shape == v_cache.shape
            and q.shape[-1] == k_cache.shape[-1]):
        raise ValueError(f"paged_decode_attention_cpu: q {q.dtype} {tuple(q.shape)} does not fit the caches "
                         f"{k_cache.dtype} {tuple(k_cache.shape)} / {v_cache.dtype} {tuple(v_cache.shape)}")
    entry = _entry_point()
    if entry is None:
        longest = int(context_lens.max()) if context_lens.numel() else 0
        index = build_decode_kv_index(block_tables, context_lens, longest, k_cache.shape[1])
        return decode_attention(q, k_cache, v_cache, index, scale)
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    batch, heads, head_dim = q.shape
    out = torch.empty(batch, heads, head_dim, dtype=q.dtype)
    status = entry(_DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(),
                   v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
                   out.data_ptr(), batch, heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale,
                   torch.get_num_threads())
    assert status == 0, "shapes outside kernel_supports reached the CPU decode kernel"
    return out


@paged_decode_attention_cpu.register_fake
@paged_decode_attention_cpu_reference.register_fake
def _(q, k_cache, v_cache, block_tables, context_lens, scale):
    return q.new_empty(q.shape)
