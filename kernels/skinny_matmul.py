"""y = x @ w^T + bias for one or a few rows of x (decode batches): a product that streams the weight.

With a row or two the product is bound by reading the weight, [N, K] in x's dtype, and its
arithmetic is negligible. cuBLAS's kernels for such shapes read the projections of a small model
at a fraction of the memory's rate (on an H100: about 720 GB/s for Qwen3-0.6B's 1,024 x 2,048
projection, about 810 GB/s for its 1,024 x 3,072 one, which it splits along K and reduces with a
second kernel), and a decode step of such a model spends most of its GPU time in them.

Each program owns BLOCK_N whole weight rows and walks K in BLOCK_K steps: one load of a
[BLOCK_N, BLOCK_K] tile (contiguous along K, so wide coalesced loads), then for each of x's rows
a broadcast multiply and a float32 sum over the step; the rows of x are tiny and come from the
cache. No K split: the grid is N / BLOCK_N programs, narrow enough to cover the GPU, so one
launch writes the finished product (no partial sums, no second kernel), and a row's result does
not depend on the other rows. Its sums per row make it slower than cuBLAS's tensor-core tiles
from four rows on, so the layers call it for one or two by default (`SKINNY_MAX_ROWS_ON_CUDA`).
Launches depend only on shapes, so they can be captured in CUDA graphs. On Hopper it launches
as a programmatic dependent (`programmatic_launch`): its first weight tile streams in while the
kernel in front finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .programmatic_launch import gdc_launch_dependents, gdc_wait, launch_options, programmatic_launch
from .triton_types import TL_DTYPES

SKINNY_ROWS = 8


@triton.jit
def _weight_tile(w_rows, k0, K, col_ok, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at inputs k0.., in float32 (zeros past N and K)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None], other=0.0)
    else:
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
    return w.to(tl.float32)


@triton.jit
def _add_rows_times_tile(acc, w, x_ptr, stride_xm, M, K, k0, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc[r] += w @ x[r, k0:k0 + BLOCK_K] for each of x's rows (rows past M read nothing)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    row_ids = tl.arange(0, ROWS)
    for r in tl.static_range(ROWS):
        row_ok = tl.full((BLOCK_K,), r, tl.int32) < M
        x = tl.load(x_ptr + r * stride_xm + ks, mask=(ks < K) & row_ok, other=0.0).to(tl.float32)
        part = tl.sum(w * x[None, :], axis=1)
        acc = tl.where(row_ids[:, None] == r, acc + part[None, :], acc)
    return acc


@triton.jit
def skinny_first_tile(pid, w_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr):
    """Program pid's first weight tile: what it may load before the kernel in front has
    finished, since no kernel of a step writes weights."""
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    return _weight_tile(w_ptr + cols[:, None].to(tl.int64) * stride_wn, 0, K, cols < N, BLOCK_K, EVEN_K)


@triton.jit
def skinny_program(
    pid, w, x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """out[:M, cols] for program pid's BLOCK_N columns, given its first weight tile w
    (`skinny_first_tile`); ROWS is M rounded up to a power of two."""
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    row_ids = tl.arange(0, ROWS)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    acc = _add_rows_times_tile(tl.zeros((ROWS, BLOCK_N), dtype=tl.float32), w, x_ptr, stride_xm, M, K, 0,
                               ROWS, BLOCK_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = _weight_tile(w_rows, k0, K, col_ok, BLOCK_K, EVEN_K)
        acc = _add_rows_times_tile(acc, w, x_ptr, stride_xm, M, K, k0, ROWS, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_at = out_ptr + row_ids[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=(row_ids < M)[:, None] & col_ok[None, :])


@triton.jit
def _skinny_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):
    """out[:M, cols] for this program's BLOCK_N columns; ROWS is M rounded up to a power of two."""
    pid = tl.program_id(0)
    # The first weight tile is asked for before waiting on the kernel in front (no kernel of a
    # step writes weights): launched as its dependent, the load overlaps that kernel's tail.
    w = skinny_first_tile(pid, w_ptr, N, K, stride_wn, BLOCK_N, BLOCK_K, EVEN_K)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    skinny_program(pid, w, x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   ROWS, BLOCK_N, BLOCK_K, EVEN_K, HAS_BIAS)


@dataclass(frozen=True)
class SkinnyTiling:
    """A launch's shape: weight rows a program owns, inputs a K step reads, warps."""

    block_n: int
    block_k: int
    num_warps: int = 4


# The widest K step of the default tiling (read at each launch). A program's first step is what
# it reads before waiting for the kernel in front, so a step of all of K (2,048 for Qwen3-0.6B's
# o_proj, 3,072 in a masked 4,096 for its down_proj) would have a product's whole weight asked
# for while attention or gate|up still runs; alone, without a kernel in front, 1,024 was the
# fastest of the steps swept (up to 1,024). `benchmarks/gpu_decode.py --skinny-block-k` times the
# whole step with wider ones.
SKINNY_MAX_BLOCK_K = 1024


def default_skinny_tiling(k: int, max_block_k: int | None = None) -> SkinnyTiling:
    """Two weight rows a program and K steps of up to `max_block_k` inputs (None:
    `SKINNY_MAX_BLOCK_K`): the fastest or within 0.2 us of it at one and two rows on every
    projection of Qwen3-0.6B and its LM head in a sweep on an H100
    (`benchmarks/gpu_skinny_matmul_sweep.py`): many small programs keep the most loads in flight
    on these few-megabyte weights."""
    widest = SKINNY_MAX_BLOCK_K if max_block_k is None else max_block_k
    return SkinnyTiling(2, min(widest, triton.next_power_of_2(k)))


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
    if bias is not None:
        bias = bias.contiguous()  # read at stride 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        tiling = tiling or default_skinny_tiling(k)
        pdl = programmatic_launch(x.device)
        _skinny_matmul_kernel[(triton.cdiv(n, tiling.block_n),)](
            rows, weight, bias if bias is not None else weight, out, m, n, k, rows.stride(0), weight.stride(0), n,
            ROWS=triton.next_power_of_2(m), BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k,
            EVEN_K=k % tiling.block_k == 0, HAS_BIAS=bias is not None, PDL=pdl, num_warps=tiling.num_warps,
            **launch_options(pdl),
        )
    return out.reshape(*x.shape[:-1], n)
