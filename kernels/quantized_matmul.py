"""Weight-only quantized matmul for CUDA: y = x @ dequantize(codes, scales, mins)^T + bias.

The layout is `fastgen.quantization.formats`': int8 codes [N, K] (w = code * scale), or 4-bit
codes two a byte [N, K / 2] (in a group of G inputs, byte j holds input j low and input j + G/2
high; w = (code - 8) * scale, or code * scale + min), float16 scales and minimums [N, K / G].

Each program computes a [BLOCK_M, BLOCK_N] tile of y: it walks K in BLOCK_K steps, loads the
codes of its BLOCK_N weight rows, dequantizes them in registers (the codes are read from memory
once, as 8 or 4 bits; no float weight is ever written) and multiplies with `tl.dot` in float32.
The launch depends only on tensor shapes, so it can be captured in a CUDA graph.
"""

import torch
import triton
import triton.language as tl

from .triton_types import dot_dtype


@triton.jit
def _quantized_matmul_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_om,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    groups = K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = col_ok[:, None] & k_ok[None, :]
        group = ks // GROUP
        if BITS == 8:
            q = tl.load(codes_ptr + cols[:, None].to(tl.int64) * K + ks[None, :], mask=w_ok, other=0).to(tl.float32)
        else:
            half = GROUP // 2
            within = ks % GROUP
            byte = group * half + within % half
            packed = tl.load(codes_ptr + cols[:, None].to(tl.int64) * (K // 2) + byte[None, :], mask=w_ok, other=0)
            shift = (within >= half).to(tl.int32) * 4
            q = ((packed.to(tl.int32) >> shift[None, :]) & 15).to(tl.float32)
        scale_at = cols[:, None].to(tl.int64) * groups + group[None, :]
        scale = tl.load(scales_ptr + scale_at, mask=w_ok, other=0.0).to(tl.float32)
        if BITS == 8:
            w = q * scale
        elif HAS_MINS:
            w = q * scale + tl.load(mins_ptr + scale_at, mask=w_ok, other=0.0).to(tl.float32)
        else:
            w = (q - 8.0) * scale
        # The weight rounded to x's dtype before its products, as the dequantize-then-matmul
        # reference does; the sums stay in float32 (exact float32 products for float32 inputs).
        w = w.to(x.dtype).to(DOT_DTYPE)
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w), out_dtype=tl.float32, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def quantized_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                     bias: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """x [..., K] (float32 / float16 / bf16) times the quantized weight's transpose: [..., N] in
    x's dtype. ValueError for shapes that do not fit the layout."""
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
    if m and n:
        # tl.dot needs tiles of at least 16 a side; 16 rows cover a decode batch of up to 16.
        block_m = 16 if m <= 16 else 64
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
        _quantized_matmul_kernel[grid](
            rows, codes.contiguous(), scales.contiguous(), mins.contiguous() if mins is not None else scales,
            bias.contiguous() if bias is not None else scales, out, m, n, k, rows.stride(0), out.stride(0),
            BITS=bits, GROUP=group_size, HAS_MINS=mins is not None, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, DOT_DTYPE=dot_dtype(x.dtype),
        )
    return out.reshape(*x.shape[:-1], n)
