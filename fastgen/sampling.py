"""The arithmetic of sampling one token per row, as a pure function of tensors (compilable).

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with
probability p_i. The noise comes from the caller, so each request can draw it from its own seeded
generator and its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    noise: torch.Tensor,
    filter_top_k_top_p: bool,
) -> torch.Tensor:
    """Pick one token per row.

    logits: float32 [B, V]. temperatures: float32 [B], 0 means greedy. top_k: int64 [B], V when
    disabled. top_p: float32 [B], 1.0 when disabled. noise: float32 [B, V] of Exp(1) draws.
    filter_top_k_top_p: False skips the sort when no row asks for top-k or top-p.
    Returns int64 [B].
    """
    greedy = logits.argmax(dim=-1)
    safe_t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    scaled = logits / safe_t.unsqueeze(1)
    if filter_top_k_top_p:
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(temperatures > 0, sampled, greedy)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k and outside its top-p nucleus.

    The nucleus keeps the smallest prefix of the sorted tokens whose mass reaches top_p, so the
    most likely token always survives.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop = drop | (mass_before >= top_p.unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
