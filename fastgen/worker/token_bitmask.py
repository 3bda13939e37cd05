"""A grammar's token bitmask applied to logits: tokens it does not allow get -inf.

The mask is xgrammar's layout (int32 words, bit t % 32 of word t // 32 for token t; little-endian,
so byte t // 8, bit t % 8). Each mask byte is looked up in a table of its 8 additive values (0 for
an allowed token, -inf for the others) and the rows are added to the logits: two passes over
[rows, vocab] floats, an order of magnitude cheaper than unpacking bits and a masked select. Plain
tensor ops, so the same code runs on the CPU and on CUDA (a few small kernels, off the decode
graph, like the rest of the sampler).
"""

from __future__ import annotations

import torch

_TABLES: dict[torch.device, torch.Tensor] = {}


def _byte_table(device: torch.device) -> torch.Tensor:
    """float32 [256, 8]: row b holds 0 where bit i of b is set, else -inf."""
    table = _TABLES.get(device)
    if table is None:
        bits = torch.bitwise_and(torch.arange(256).unsqueeze(-1) >> torch.arange(8), 1).bool()
        table = _TABLES[device] = torch.where(bits, 0.0, float("-inf")).float().to(device)
    return table


def additive_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask: int32 [R, ceil(vocab / 32)] -> float32 [R, vocab_size]: 0 where allowed, -inf not."""
    table = _byte_table(bitmask.device)
    rows = bitmask.shape[0]
    flat = table.index_select(0, bitmask.contiguous().view(torch.uint8).view(-1).int())
    return flat.view(rows, -1)[:, :vocab_size]


def mask_disallowed(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor) -> torch.Tensor:
    """A float32 copy of `logits` [B, V] whose rows `rows` (int64 [R]; None: every row, in order)
    keep only the tokens their row of `bitmask` (int32 [R, W], on the logits' device) allows; the
    others are -inf."""
    mask = additive_mask(bitmask, logits.shape[-1])
    out = logits.float() if logits.dtype != torch.float32 else logits.clone()
    return out.add_(mask) if rows is None else out.index_add_(0, rows, mask)
