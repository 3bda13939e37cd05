"""Weight-only quantized matmul for CUDA: y = x @ dequantize(codes, scales, mins)^T + bias.

The layout is `fastgen.quantization.formats`': int8 codes [N, K] (w = code * scale), or 4-bit
codes two a byte [N, K / 2] (in a group of G inputs, byte j holds input j low and input j + G/2
high; w = (code - 8) * scale, or code * scale + min), float16 scales and minimums [N, K / G].

Each program computes a [BLOCK_M, BLOCK_N] tile of y over one slice of K: it loads the codes of
its BLOCK_N weight rows (read from memory once, as 8 or 4 bits; no float weight is ever
written), dequantizes them in registers and multiplies in float32. 4-bit codes are walked by
byte: a byte's low and high nibbles are two inputs half a group apart, so each step loads one
contiguous run of bytes and the two runs of x that match its nibbles.

Decode batches are matrix-vector products whose weights have few rows (a 1,024-wide projection
is 16 tiles of 64): tiles alone would leave most of the GPU idle. So:
- up to GEMV_ROWS rows the products are broadcast multiplies and sums on narrow tiles (tl.dot
  needs 16 rows; a batch of one would waste 15 of them);
- K is split between programs until the grid covers the GPU about twice; the slices' float32
  partial sums are added in a fixed order after the kernel (no atomics: the result does not
  depend on the order programs ran in).
Launches depend only on tensor shapes, so they can be captured in a CUDA graph.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_types import dot_dtype, interpreting

GEMV_ROWS = 4


@triton.jit
def _tile_product(acc, x, w, DOT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """acc [M, N] + x [M, K] @ w [N, K]^T, in float32 (w already rounded to x's dtype)."""
    if DOT:
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), out_dtype=tl.float32, input_precision="ieee")
    else:
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _per_group(ptr, cols, col_ok, groups, b0, bs, w_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_BYTES: tl.constexpr, MODE: tl.constexpr):
    """The float32 scales (or minimums) of a step's code bytes, [BLOCK_N, BLOCK_K] or a
    broadcastable [BLOCK_N, 1]: MODE 1, the step lies inside one group (a value a row); MODE 2,
    the step holds whole groups (a value a group, repeated over its bytes); MODE 0, a value
    looked up for every byte."""
    row_at = cols.to(tl.int64) * groups
    if MODE == 1:
        return tl.load(ptr + row_at + b0 // GROUP_BYTES, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    elif MODE == 2:
        PER_STEP: tl.constexpr = BLOCK_K // GROUP_BYTES
        g = b0 // GROUP_BYTES + tl.arange(0, PER_STEP)
        v = tl.load(ptr + row_at[:, None] + g[None, :], mask=col_ok[:, None] & (g < groups)[None, :],
                    other=0.0).to(tl.float32)
        return tl.reshape(tl.broadcast_to(v[:, :, None], (BLOCK_N, PER_STEP, GROUP_BYTES)), (BLOCK_N, BLOCK_K))
    else:
        return tl.load(ptr + row_at[:, None] + (bs // GROUP_BYTES)[None, :], mask=w_ok, other=0.0).to(tl.float32)


@triton.jit
def _quantized_matmul_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_om, stride_os, STEPS_PER_SPLIT,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, SCALE_MODE: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile over K steps [pid_k * STEPS_PER_SPLIT, ...) of BLOCK_K
    inputs (8 bits) or BLOCK_K bytes (4 bits). out: y itself (one split: bias added, cast), or
    float32 partial sums [splits, M, N] (stride_os apart)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    groups = K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    width = K if BITS == 8 else K // 2  # code bytes a weight row holds
    first = pid_k * STEPS_PER_SPLIT * BLOCK_K
    last = tl.minimum(first + STEPS_PER_SPLIT * BLOCK_K, width)
    GROUP_BYTES: tl.constexpr = GROUP if BITS == 8 else GROUP // 2
    for b0 in range(first, last, BLOCK_K):
        bs = b0 + tl.arange(0, BLOCK_K)  # code bytes of this step
        b_ok = bs < width
        w_ok = col_ok[:, None] & b_ok[None, :]
        packed = tl.load(codes_ptr + cols[:, None].to(tl.int64) * width + bs[None, :], mask=w_ok, other=0)
        group = bs // GROUP_BYTES
        scale = _per_group(scales_ptr, cols, col_ok, groups, b0, bs, w_ok, BLOCK_N, BLOCK_K, GROUP_BYTES, SCALE_MODE)
        if BITS == 8:
            x = tl.load(x_rows + bs[None, :], mask=row_ok[:, None] & b_ok[None, :], other=0.0)
            w = (packed.to(tl.float32) * scale).to(x.dtype)
            acc = _tile_product(acc, x, w, DOT, DOT_DTYPE)
        else:
            # Byte b of group g holds inputs g * GROUP + b % (GROUP / 2) (low) and that + GROUP / 2.
            ks_low = bs + group * (GROUP // 2)
            x_ok = row_ok[:, None] & b_ok[None, :]
            x_low = tl.load(x_rows + ks_low[None, :], mask=x_ok, other=0.0)
            x_high = tl.load(x_rows + (ks_low + GROUP // 2)[None, :], mask=x_ok, other=0.0)
            q = packed.to(tl.int32)
            q_low = (q & 15).to(tl.float32)
            q_high = ((q >> 4) & 15).to(tl.float32)
            if HAS_MINS:
                offset = _per_group(mins_ptr, cols, col_ok, groups, b0, bs, w_ok, BLOCK_N, BLOCK_K, GROUP_BYTES,
                                    SCALE_MODE)
                w_low = q_low * scale + offset
                w_high = q_high * scale + offset
            else:
                w_low = (q_low - 8.0) * scale
                w_high = (q_high - 8.0) * scale
            acc = _tile_product(acc, x_low, w_low.to(x_low.dtype), DOT, DOT_DTYPE)
            acc = _tile_product(acc, x_high, w_high.to(x_high.dtype), DOT, DOT_DTYPE)
    out_at = out_ptr + pid_k.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    if stride_os == 0:  # one split: the finished product
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    else:
        tl.store(out_at, acc, mask=row_ok[:, None] & col_ok[None, :])


@functools.lru_cache(maxsize=None)
def _num_programs_wanted(device: torch.device) -> int:
    """About two programs a multiprocessor; under the interpreter a small number, so the CPU
    tests split K too."""
    if device.type != "cuda" or interpreting():
        return 8
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def split_k_for(tiles: int, steps: int, programs_wanted: int) -> int:
    """How many slices K is cut into: enough for `tiles` output tiles to fill the programs
    wanted, at most one a K step."""
    if tiles >= programs_wanted:
        return 1
    return max(1, min(steps, -(-programs_wanted // tiles)))


@dataclass(frozen=True)
class Tiling:
    """A launch's shape: output columns and K step (inputs at 8 bits, bytes at 4) a program
    takes, its warps, and the programs K is split to reach (None: two a multiprocessor)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    programs_wanted: int | None = None
    group_scales: bool = True  # a scale a group, repeated, where a step holds whole groups


def default_tiling(rows: int, bits: int) -> Tiling:
    """Narrow tiles with long K steps for decode rows (the fastest of a sweep on an H200,
    `benchmarks/gpu_quantized_matmul_sweep.py`), tensor-core tiles above."""
    if rows <= GEMV_ROWS:
        return Tiling(8, 512 if bits == 8 else 256)
    return Tiling(32, 64 if bits == 8 else 32)


def quantized_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                     bias: torch.Tensor | None, bits: int, group_size: int, split_k: int | None = None,
                     tiling: Tiling | None = None) -> torch.Tensor:
    """x [..., K] (float32 / float16 / bf16) times the quantized weight's transpose: [..., N] in
    x's dtype. split_k: slices of K (None: chosen for the GPU); tiling: the launch's shape (None:
    the default for this many rows). ValueError for shapes that do not fit the layout."""
    k = x.shape[-1]
    n = codes.shape[0]
    if bits not in (4, 8) or group_size < 1 or k % group_size or codes.shape[1] != (k if bits == 8 else k // 2) \
            or scales.shape != (n, k // group_size) or (bits == 4 and group_size % 2):
        raise ValueError(f"quantized_matmul: x [..., {k}], codes {tuple(codes.shape)}, scales {tuple(scales.shape)} "
                         f"do not fit {bits}-bit codes in groups of {group_size}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if not (m and n):
        return out.reshape(*x.shape[:-1], n)
    gemv = m <= GEMV_ROWS
    # tl.dot needs tiles of at least 16 a side; 16 rows cover a decode batch of up to 16.
    block_m = triton.next_power_of_2(m) if gemv else (16 if m <= 16 else 64)
    tiling = tiling or default_tiling(m, bits)
    block_n, block_k = tiling.block_n, tiling.block_k
    width = k if bits == 8 else k // 2
    group_bytes = group_size if bits == 8 else group_size // 2
    scale_mode = 1 if group_bytes % block_k == 0 else (2 if block_k % group_bytes == 0 and tiling.group_scales else 0)
    steps = triton.cdiv(width, block_k)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    splits = split_k or split_k_for(tiles, steps, tiling.programs_wanted or _num_programs_wanted(x.device))
    steps_per_split = triton.cdiv(steps, splits)
    splits = triton.cdiv(steps, steps_per_split)  # none empty
    partial = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _quantized_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)](
        rows, codes.contiguous(), scales.contiguous(), mins.contiguous() if mins is not None else scales,
        bias.contiguous() if bias is not None else scales, partial, m, n, k, rows.stride(0), n,
        0 if splits == 1 else m * n, steps_per_split,
        BITS=bits, GROUP=group_size, HAS_MINS=mins is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT=not gemv, DOT_DTYPE=dot_dtype(x.dtype),
        SCALE_MODE=scale_mode, num_warps=tiling.num_warps,
    )
    if splits > 1:
        total = partial.sum(0)
        if bias is not None:
            total += bias.float()
        out.copy_(total)
    return out.reshape(*x.shape[:-1], n)
