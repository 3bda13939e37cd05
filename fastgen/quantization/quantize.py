"""Float weights into codes and scales (`quantize_weight`) and back (`dequantize`).

`dequantize` defines what a quantized weight means: code times scale (plus minimum, or minus 8
scales) in float32, rounded once to the asked dtype. Every kernel is tested against
`F.linear(x, dequantize(...))`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fastgen.quantization.formats import QuantFormat


class QuantizedTensors(NamedTuple):
    codes: torch.Tensor  # int8 [N, K] or uint8 [N, K / 2]
    scales: torch.Tensor  # float16 [N, K / group_size]
    mins: torch.Tensor | None  # float16 [N, K / group_size], or None


def quantize_weight(weight: torch.Tensor, fmt: QuantFormat) -> QuantizedTensors:
    """Round `weight` [N, K] to `fmt`: 8 bits symmetric, scale = absmax / 127; 4 bits with
    minimums as llama.cpp's Q4_1 (min = the group's smallest weight, scale = its range / 15, so
    both ends are exact); 4 bits without as Q4_0 (scale = -(the group's value of largest
    magnitude) / 8, so that value is exact and the codes span [-8, 7]). Codes are computed from
    the float16-rounded scale (and minimum) they will be multiplied by."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // fmt.group_size, fmt.group_size)
    if fmt.bits == 8:
        scale = (groups.abs().amax(-1) / 127).half()
        inverse = 1 / torch.where(scale == 0, 1, scale.float())
        codes = (groups * inverse[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(n, k)
        return QuantizedTensors(codes, scale, None)
    mins = None
    if fmt.has_mins:
        low = groups.amin(-1).half()
        scale = ((groups.amax(-1) - low.float()) / 15).half()
        inverse = 1 / torch.where(scale == 0, 1, scale.float())
        q = ((groups - low.float()[..., None]) * inverse[..., None]).round().clamp(0, 15).to(torch.uint8)
        mins = low
    else:
        index = groups.abs().argmax(-1, keepdim=True)
        scale = (groups.gather(-1, index).squeeze(-1) / -8).half()
        inverse = 1 / torch.where(scale == 0, 1, scale.float())
        q = ((groups * inverse[..., None]).round() + 8).clamp(0, 15).to(torch.uint8)
    half = fmt.group_size // 2
    codes = (q[..., :half] | (q[..., half:] << 4)).reshape(n, k // 2)
    return QuantizedTensors(codes, scale, mins)


def unpack_codes(codes: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """The codes as one value per input, [N, K]: int8 as stored; 4-bit nibbles as 0..15."""
    if fmt.bits == 8:
        return codes
    n = codes.shape[0]
    grouped = codes.reshape(n, -1, fmt.group_size // 2)
    return torch.cat([grouped & 15, grouped >> 4], dim=-1).reshape(n, -1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, fmt: QuantFormat,
               dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] that `codes`, `scales` and `mins` stand for, in `dtype`."""
    q = unpack_codes(codes, fmt).float()
    n, k = q.shape
    q = q.reshape(n, k // fmt.group_size, fmt.group_size)
    scale = scales.float()[..., None]
    if fmt.bits == 8:
        w = q * scale
    elif mins is None:
        w = (q - 8) * scale
    else:
        w = q * scale + mins.float()[..., None]
    return w.reshape(n, k).to(dtype)
