"""RMSNorm, then a decode batch's product, then optionally SwiGLU, in one launch: what a
Llama-family layer does between its residual stream and q|k|v, and between it and the MLP's
down projection.

At one or two rows, unfused, a layer launches an add+RMSNorm kernel before each of its two
merged products and a SwiGLU kernel after gate|up: three of its ten kernels, each a microsecond
or two of work behind its own launch. Here every program of the product (`skinny_matmul`'s
layout: BLOCK_N whole weight rows, and all of K in one tile) loads the rows of x and of the
residual, adds them and normalises them itself (a few kilobytes that every program reads from
L2 anyway), then multiplies. With SWIGLU a program owns gate rows j and up rows N + j of a
merged [2N, K] weight and writes silu(gate) * up.

Rounding follows the unfused ops (`fastgen.compile.ops`, eager torch): the residual add in
x's dtype; the norm in float32, cast to x's dtype, times the weight and rounded; the product
summed in float32 and rounded to x's dtype; silu rounded before the multiply. The new residual
(x + residual) goes to its own buffer, written by the first program, since every program
reads the old one. On Hopper the launch is a programmatic dependent (`programmatic_launch`):
the weight tiles are asked for before waiting on the kernel in front.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .programmatic_launch import gdc_launch_dependents, gdc_wait, launch_options, programmatic_launch
from .skinny_matmul import SKINNY_ROWS
from .triton_types import TL_DTYPES

# All of K sits in one tile, in registers: up to 4,096 inputs (Llama-3-8B's hidden size).
MAX_NORMED_K = 4096


@triton.jit
def normed_weight_tiles(pid, w_ptr, norm_w_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SWIGLU: tl.constexpr):
    """Program pid's weight tiles (gate, and up with SWIGLU; gate again without) and the norm's
    weight, in float32: all it reads that no kernel of a step writes, so it may load them
    before the kernel in front has finished."""
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    tile_mask = (cols < N)[:, None] & (ks < K)[None, :]
    w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=tile_mask, other=0.0)
    w = w.to(tl.float32)
    w_up = w
    if SWIGLU:
        w_up = tl.load(w_ptr + (cols + N)[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=tile_mask, other=0.0)
        w_up = w_up.to(tl.float32)
    norm_w = tl.load(norm_w_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    return w, w_up, norm_w


@triton.jit
def normed_program(
    pid, w, w_up, norm_w, x_ptr, res_ptr, bias_ptr, out_ptr, res_out_ptr,
    M, N, K, eps,
    stride_xm, stride_rm, stride_om, stride_rom,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
):
    """out[:M, cols] for program pid's BLOCK_N columns (of N; the weight has 2N rows with
    SWIGLU), given its tiles (`normed_weight_tiles`); ROWS is M rounded up to a power of two.
    Program 0 writes the new residual."""
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    dtype = x_ptr.dtype.element_ty
    row_ids = tl.arange(0, ROWS)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for r in tl.static_range(ROWS):
        # x's rows past M read nothing; their sums are zero and never stored.
        row_ok = k_ok & (tl.full((BLOCK_K,), r, tl.int32) < M)
        h = tl.load(x_ptr + r * stride_xm + ks, mask=row_ok, other=0.0)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + r * stride_rm + ks, mask=row_ok, other=0.0)
            h = (h.to(tl.float32) + res.to(tl.float32)).to(dtype)
            if pid == 0:
                tl.store(res_out_ptr + r * stride_rom + ks, h, mask=row_ok)
        hf = h.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(hf * hf, axis=0) / K + eps)
        normed = (norm_w * (hf * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        acc = tl.where(row_ids[:, None] == r, acc + tl.sum(w * normed[None, :], axis=1)[None, :], acc)
        if SWIGLU:
            acc_up = tl.where(row_ids[:, None] == r, acc_up + tl.sum(w_up * normed[None, :], axis=1)[None, :],
                              acc_up)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(bias_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        acc = silu * acc_up.to(dtype).to(tl.float32)
    out_at = out_ptr + row_ids[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_at, acc.to(dtype), mask=(row_ids < M)[:, None] & col_ok[None, :])


@triton.jit
def _normed_skinny_matmul_kernel(
    x_ptr, res_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr, res_out_ptr,
    M, N, K, eps,
    stride_xm, stride_rm, stride_wn, stride_om, stride_rom,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, PDL: tl.constexpr,
):
    """out[:M, cols] for this program's BLOCK_N columns (of N; the weight has 2N rows with
    SWIGLU); ROWS is M rounded up to a power of two."""
    pid = tl.program_id(0)
    # Weights first: no kernel of a step writes them, so they load while the one in front ends.
    w, w_up, norm_w = normed_weight_tiles(pid, w_ptr, norm_w_ptr, N, K, stride_wn, BLOCK_N, BLOCK_K, SWIGLU)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    normed_program(pid, w, w_up, norm_w, x_ptr, res_ptr, bias_ptr, out_ptr, res_out_ptr, M, N, K, eps,
                   stride_xm, stride_rm, stride_om, stride_rom, ROWS, BLOCK_N, BLOCK_K,
                   HAS_RESIDUAL, HAS_BIAS, SWIGLU)


@dataclass(frozen=True)
class NormedTiling:
    """A launch's shape: weight rows (of each half, with SwiGLU) a program owns, and warps."""

    block_n: int
    num_warps: int


def default_normed_tiling(k: int) -> NormedTiling:
    """Eight weight rows a program (of each half, with SwiGLU) up to 1,024 inputs, four with 8
    warps beyond, so that a program holds at most 128 weight values a thread. Every program
    normalises x again, so fewer, wider programs than the plain product's two rows pay off: on
    an H100 eight rows and 4 warps were the fastest of 2/4/8 rows x 4/8 warps at one and two
    rows for Qwen3-0.6B's q|k|v and gate|up (`benchmarks/gpu_normed_matmul_sweep.py`)."""
    return NormedTiling(8, 4) if k <= 1024 else NormedTiling(4, 8)


def normed_skinny_matmul(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                         weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False,
                         tiling: NormedTiling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) for h = x + residual (x when residual is None) and
    y = rms_norm(h) * norm_weight @ weight^T + bias; with `swiglu`, weight [2N, K] (and bias
    [2N]) hold gate then up, and y = silu(y[..., :N]) * y[..., N:].

    x, residual: [..., K] with at most SKINNY_ROWS rows, K <= MAX_NORMED_K; norm_weight [K];
    weight [N or 2N, K]; one float dtype throughout (float32 sums). y is [..., N] in x's dtype.
    ValueError for shapes or dtypes it does not take.
    """
    k = x.shape[-1]
    n_total = weight.shape[0] if weight.dim() == 2 else -1
    n = n_total // 2 if swiglu else n_total
    fits = (weight.dim() == 2 and weight.shape[1] == k and norm_weight.shape == (k,)
            and (residual is None or residual.shape == x.shape)
            and (bias is None or bias.shape == (n_total,)) and not (swiglu and n_total % 2))
    if not fits:
        raise ValueError(f"normed_skinny_matmul: x {tuple(x.shape)}, residual "
                         f"{None if residual is None else tuple(residual.shape)}, norm weight "
                         f"{tuple(norm_weight.shape)}, weight {tuple(weight.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)}, swiglu={swiglu} do not fit")
    dtypes = {t.dtype for t in (x, residual, norm_weight, weight, bias) if t is not None}
    if x.dtype not in TL_DTYPES or len(dtypes) != 1:
        raise ValueError(f"normed_skinny_matmul: dtypes {sorted(map(str, dtypes))} must be one of {list(TL_DTYPES)}")
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if m > SKINNY_ROWS or k > MAX_NORMED_K:
        raise ValueError(f"normed_skinny_matmul: {m} rows of {k} inputs, at most {SKINNY_ROWS} of {MAX_NORMED_K}")
    rows = rows.contiguous()
    res_rows = None if residual is None else residual.reshape(-1, k).contiguous()
    weight, norm_weight = weight.contiguous(), norm_weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    new_residual = x if residual is None else torch.empty_like(rows)
    if m and n:
        tiling = tiling or default_normed_tiling(k)
        pdl = programmatic_launch(x.device)
        _normed_skinny_matmul_kernel[(triton.cdiv(n, tiling.block_n),)](
            rows, rows if res_rows is None else res_rows, norm_weight, weight, weight if bias is None else bias,
            out, rows if residual is None else new_residual,
            m, n, k, eps,
            rows.stride(0), rows.stride(0), weight.stride(0), n, rows.stride(0),
            ROWS=triton.next_power_of_2(m), BLOCK_N=tiling.block_n, BLOCK_K=triton.next_power_of_2(k),
            HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, SWIGLU=swiglu, PDL=pdl,
            num_warps=tiling.num_warps, **launch_options(pdl),
        )
    if residual is not None:
        new_residual = new_residual.reshape(x.shape)
    return out.reshape(*x.shape[:-1], n), new_residual
