"""y = x @ w^T + bias for a few rows of x (decode batches): a product that streams the weight.

With one to SKINNY_ROWS rows the product is bound by reading the weight, [N, K] in x's dtype, and
its arithmetic is negligible. cuBLAS's kernels for such shapes reach a fraction of the memory's
rate on the projections of a small model (on an H200: 330 GB/s for a 1,024 x 2,048 projection,
split-K plus a reduction kernel), so decode steps spend most of their GPU time there.

Each program owns BLOCK_N whole weight rows and walks K in BLOCK_K steps: one load of a
[BLOCK_N, BLOCK_K] tile (contiguous along K, so wide coalesced loads), then for each of x's rows
a broadcast multiply and a float32 sum over the step; the rows of x are tiny and come from the
cache. No K split: the grid is N / BLOCK_N programs, narrow enough to cover the GPU, so one
launch writes the finished product (no partial sums, no second kernel), and a row's result does
not depend on the other rows. Launches depend only on shapes, so they can be captured in CUDA
graphs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_types import TL_DTYPES, interpreting

SKINNY_ROWS = 8


@triton.jit
def _skinny_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """out[:M, cols] for this program's BLOCK_N columns; ROWS is M rounded up to a power of two."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    row_ids = tl.arange(0, ROWS)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None], other=0.0)
        else:
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
        w = w.to(tl.float32)
        for r in tl.static_range(ROWS):
            # x's rows past M read nothing; their sums are zero and never stored.
            row_ok = tl.full((BLOCK_K,), r, tl.int32) < M
            x = tl.load(x_ptr + r * stride_xm + ks, mask=(ks < K) & row_ok, other=0.0).to(tl.float32)
            part = tl.sum(w * x[None, :], axis=1)
            acc = tl.where(row_ids[:, None] == r, acc + part[None, :], acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_at = out_ptr + row_ids[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=(row_ids < M)[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class SkinnyTiling:
    """A launch's shape: weight rows a program owns, inputs a K step reads, warps."""

    block_n: int
    block_k: int
    num_warps: int = 4


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda" or interpreting():
        return 4  # under the interpreter: small, so the CPU tests see several programs and ragged edges
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_skinny_tiling(n: int, k: int, device: torch.device) -> SkinnyTiling:
    """The narrowest-rows choice that still leaves each program a long run of K: as many weight
    rows a program as keep at least two programs a multiprocessor (few rows a program for
    1,024-wide projections, more for the LM head), and K steps of up to 512 inputs."""
    programs_wanted = 2 * _multiprocessors(device)
    block_n = 2
    while block_n < 16 and triton.cdiv(n, block_n * 2) >= programs_wanted:
        block_n *= 2
    block_k = min(512, triton.next_power_of_2(k))
    return SkinnyTiling(block_n, block_k)


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tiling: SkinnyTiling | None = None) -> torch.Tensor:
    """x [..., K] (at most SKINNY_ROWS rows) times weight [N, K] transposed, plus bias [N]: [..., N]
    in x's dtype (float32 sums). ValueError for shapes or dtypes it does not take."""
    k = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k or (bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError(f"skinny_matmul: x [..., {k}], weight {tuple(weight.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit y = x @ weight^T + bias")
    if x.dtype not in TL_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"skinny_matmul: x {x.dtype} and weight {weight.dtype} must be one of {list(TL_DTYPES)}")
    rows = x.reshape(-1, k)
    m, n = rows.shape[0], weight.shape[0]
    if m > SKINNY_ROWS:
        raise ValueError(f"skinny_matmul: {m} rows, at most {SKINNY_ROWS}")
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        tiling = tiling or default_skinny_tiling(n, k, x.device)
        _skinny_matmul_kernel[(triton.cdiv(n, tiling.block_n),)](
            rows, weight, bias if bias is not None else weight, out, m, n, k, rows.stride(0), weight.stride(0), n,
            ROWS=triton.next_power_of_2(m), BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k,
            EVEN_K=k % tiling.block_k == 0, HAS_BIAS=bias is not None, num_warps=tiling.num_warps,
        )
    return out.reshape(*x.shape[:-1], n)
