"""Dtype plumbing the kernels share: torch to Triton dtypes, and what `tl.dot` may multiply."""

from __future__ import annotations

import os

import torch
import triton.language as tl

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tests), where kernels run on numpy."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_dtype(dtype: torch.dtype):
    """The Triton dtype `tl.dot` operands are cast to for a cache of `dtype`.

    On a GPU: the cache's own dtype (bf16/fp16 run on tensor cores; fp32 asks for
    input_precision="ieee" in the kernels, so it stays exact). Under the interpreter: fp32,
    because its tl.dot multiplies bf16's raw uint16 storage.
    """
    if dtype not in TL_DTYPES:
        raise ValueError(f"dtype must be one of {list(TL_DTYPES)}, got {dtype}")
    return tl.float32 if interpreting() else TL_DTYPES[dtype]
