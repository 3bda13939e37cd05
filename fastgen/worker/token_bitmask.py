"""A grammar's token bitmask applied to logits: tokens it does not allow get -inf.

The mask is xgrammar's layout (int32 words, bit t % 32 of word t // 32 for token t), computed on
the host; here it is unpacked with plain tensor ops, so the same code runs on the CPU and on CUDA
(where it is a few small kernels over [rows, vocab], off the decode graph, like the rest of the
sampler).
"""

from __future__ import annotations

import torch

BITS = 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask: int32 [R, ceil(vocab / 32)] -> bool [R, vocab_size], True where allowed."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = torch.bitwise_and(torch.bitwise_right_shift(bitmask.unsqueeze(-1), shifts), 1)
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def mask_disallowed(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A float32 copy of `logits` [B, V] whose rows `rows` (int64 [R]) keep only the tokens their
    row of `bitmask` (int32 [R, W], on the logits' device) allows; the others are -inf."""
    logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
    allowed = allowed_tokens(bitmask, logits.shape[-1])
    picked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, picked)
