"""llama.cpp's quantized blocks (GGUF) read into fastgen's layout (`fastgen.quantization.formats`).

Each of the three types is a row of blocks of 32 weights, its block's scale (and minimum) in
float16 first; fastgen's layout is the same numbers split into codes and scales:

- Q8_0: 34 bytes a block, d then 32 int8 codes: w = code * d. 8 bits, groups of 32.
- Q4_0: 18 bytes, d then 16 bytes of nibbles (byte j: weight j low, weight j + 16 high, the
  order fastgen keeps): w = (code - 8) * d. 4 bits, groups of 32.
- Q4_1: 20 bytes, d, m, then the nibbles: w = code * d + m. 4 bits, groups of 32, minimums.

Nothing is dequantized: the codes and scales are the file's, copied.
"""

from __future__ import annotations

import numpy as np
import torch

from fastgen.quantization.formats import QuantFormat
from fastgen.quantization.quantize import QuantizedTensors

# type name -> (bytes a block, format)
BLOCK_TYPES = {
    "Q8_0": (34, QuantFormat(8, 32)),
    "Q4_0": (18, QuantFormat(4, 32)),
    "Q4_1": (20, QuantFormat(4, 32, has_mins=True)),
}


def read_blocks(name: str, type_name: str, data: np.ndarray, rows: int, cols: int,
                ) -> tuple[QuantFormat, QuantizedTensors]:
    """The tensor `name` ([rows, cols] weights stored as `type_name` blocks in `data`, one row
    of bytes per weight row) as codes and scales. ValueError for another type."""
    if type_name not in BLOCK_TYPES:
        raise ValueError(f"GGUF tensor {name} is {type_name}; fastgen reads {', '.join(BLOCK_TYPES)} blocks "
                         "as they are (or F32/F16/BF16 weights, through the converted folder): load this file "
                         "with quantization=None (its converted weights) or 'int8' / 'int4'")
    block_bytes, fmt = BLOCK_TYPES[type_name]
    blocks_per_row = cols // 32
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, blocks_per_row, block_bytes)
    scales = torch.from_numpy(raw[..., 0:2].copy().view(np.float16).reshape(rows, blocks_per_row))
    mins = None
    if fmt.has_mins:
        mins = torch.from_numpy(raw[..., 2:4].copy().view(np.float16).reshape(rows, blocks_per_row))
    payload = raw[..., block_bytes - (32 if fmt.bits == 8 else 16):]
    codes = payload.copy().view(np.int8 if fmt.bits == 8 else np.uint8).reshape(rows, -1)
    return fmt, QuantizedTensors(torch.from_numpy(codes), scales, mins)
