"""The sampler's arithmetic as pure functions of tensors, so torch.compile can fuse it: the
penalties, then temperature and min_p, the top-k/top-p filter and the exponential race.
`fastgen.worker.sampler` builds their inputs per row and calls them through the op set."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastgen.checks import FLOAT32_MAX


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """The three penalties on rows `rows` of logits (a pure function of tensors, compilable).

    logits: float32 [B, V]. rows, slots: int64 [P], the penalised rows and their TokenCounts
    slots. output_counts: int32 [S, V]; prompt_mask: bool [S, V]. repetition, frequency,
    presence: float32 [P]. Returns a new float32 [B, V]; the other rows are unchanged.

    Repetition (transformers' and vLLM's rule): a token in the prompt or the output has its
    logit divided by the penalty when positive, multiplied when not. Then OpenAI's formula:
    logit -= frequency * count + presence * (count > 0), over output tokens only.
    """
    picked = logits.index_select(0, rows)
    counts = output_counts.index_select(0, slots)
    generated = counts > 0
    seen = prompt_mask.index_select(0, slots)
    seen |= generated
    # Dividing or multiplying by exactly 1.0 leaves unseen tokens' logits bit for bit. The
    # in-place steps below work on fresh intermediates: fewer [P, V] allocations in eager mode.
    penalty = torch.where(seen, repetition.unsqueeze(1), 1.0)
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    picked.addcmul_(counts, frequency.unsqueeze(1), value=-1.0)
    picked.addcmul_(generated, presence.unsqueeze(1), value=-1.0)
    return logits.index_copy(0, rows, picked)


@dataclass(frozen=True)
class NucleusFilter:
    """The rows of a sampling call whose requests ask for top-k or top-p, and what they ask.

    rows: int64 [R] on the logits' device, or None for every row. top_k: int64 [R], V when
    disabled; top_p: float32 [R], 1.0 when disabled.
    """

    rows: torch.Tensor | None
    top_k: torch.Tensor
    top_p: torch.Tensor


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    noise: torch.Tensor,
    nucleus: NucleusFilter | None = None,
    min_p: torch.Tensor | None = None,
    filter_min_p: bool = False,
    *,
    scale: Callable | None = None,
    pick: Callable | None = None,
) -> torch.Tensor:
    """Pick one token per row.

    logits: float32 [B, V]. temperatures: float32 [B], 0 means greedy. noise: float32 [B, V] of
    Exp(1) draws. nucleus: the rows to filter by top-k / top-p (None: no row asks).
    min_p: float32 [B], 0.0 when disabled; filter_min_p: False skips it when no row asks.
    Returns int64 [B].

    `scale` and `pick` are `scale_logits` and `pick_tokens` unless the op set hands in compiled
    twins. The top-k/top-p filter between them always runs eagerly: its sort is a library kernel
    either way, and Inductor's split scan for the cumulative sum over a large vocabulary fails to
    generate code on CUDA (torch 2.11, dynamic shapes), so compiling it gains nothing and risks
    the engine's start-up.
    """
    scaled = (scale or scale_logits)(logits, temperatures, min_p, filter_min_p)
    if nucleus is not None:
        if nucleus.rows is None:
            scaled = filter_top_k_top_p(scaled, nucleus.top_k, nucleus.top_p)
        else:  # (`scaled` is this call's own tensor)
            scaled.index_copy_(0, nucleus.rows, filter_top_k_top_p(scaled.index_select(0, nucleus.rows),
                                                                   nucleus.top_k, nucleus.top_p))
    return (pick or pick_tokens)(logits, scaled, temperatures, noise)


def scale_logits(logits: torch.Tensor, temperatures: torch.Tensor, min_p: torch.Tensor | None,
                 filter_min_p: bool) -> torch.Tensor:
    """Logits over each row's temperature (greedy rows: 1), with min_p's cut applied as -inf."""
    safe_t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    # Shifted by the row's largest logit first (no softmax changes): over a small temperature
    # only tokens far below the top then overflow, towards -inf, where two top ones would both
    # have reached float32's largest value and tied. Finite logits over a small temperature can
    # overflow, and inf - inf is NaN in the softmax: every scaled logit is kept finite.
    top = logits.amax(dim=-1, keepdim=True).clamp(min=-FLOAT32_MAX, max=FLOAT32_MAX)
    scaled = ((logits - top) / safe_t.unsqueeze(1)).clamp(min=-FLOAT32_MAX, max=FLOAT32_MAX)
    if filter_min_p:  # vLLM's order: after temperature, before top-k / top-p
        probs = torch.softmax(scaled, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))
    return scaled


def pick_tokens(logits: torch.Tensor, scaled: torch.Tensor, temperatures: torch.Tensor,
                noise: torch.Tensor) -> torch.Tensor:
    """Greedy rows take the raw logits' argmax; the others win the exponential race."""
    greedy = logits.argmax(dim=-1)
    probs = torch.softmax(scaled, dim=-1)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(temperatures > 0, sampled, greedy)


# How many of a row's most likely tokens the CPU's filter looks at first (a partial top-k instead
# of a sort of the whole vocabulary, several times its cost): a row whose top-k is at most this
# many is filtered among them alone, and a row asking for top-p alone is sorted whole only when
# its nucleus reaches past them. Rows with a larger top-k are sorted whole. Which way a row goes
# depends on its own settings and logits only, never on what shares its batch.
TOP_P_CANDIDATES = 256


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k and outside its top-p nucleus.

    The nucleus keeps the smallest prefix of the tokens by likelihood whose mass (after the
    top-k cut) reaches top_p. The most likely token always survives (top_k >= 1, and rank 0 is
    exempt from the top-p cut: a top_p that is 0 in float32 would otherwise drop every token
    and leave a row of NaN); a top_p of 1 cuts nothing, however the mass rounds.

    On the CPU most rows are filtered among their TOP_P_CANDIDATES most likely tokens (see
    there). On a GPU the sort is cheap, and learning which rows need it would make the host wait
    for the device: every row is sorted.
    """
    vocab = logits.shape[-1]
    if logits.device.type != "cpu" or 2 * TOP_P_CANDIDATES >= vocab:
        return _filter_sorted(logits, top_k, top_p)
    cuts = top_p < 1.0
    within = top_k <= TOP_P_CANDIDATES
    # (the CPU: reading these flags costs nothing)
    partial = (within | (top_k >= vocab)).nonzero().squeeze(1)
    if partial.numel() == 0:
        return _filter_sorted(logits, top_k, top_p)
    filtered = torch.full_like(logits, float("-inf"))
    rows = logits.index_select(0, partial)
    k, p, cut, within_k = (t.index_select(0, partial) for t in (top_k, top_p, cuts, within))
    values, order = rows.topk(TOP_P_CANDIDATES, dim=-1)  # sorted, most likely first
    ranks = torch.arange(TOP_P_CANDIDATES, device=logits.device).unsqueeze(0)
    k_cut = ranks >= k.unsqueeze(1)
    kept_values = values.masked_fill(k_cut, float("-inf"))
    # The nucleus is measured against what survives top-k: the candidates alone where the cut
    # leaves nothing else, the whole row otherwise.
    total = torch.where(within_k, torch.logsumexp(kept_values, dim=-1), torch.logsumexp(rows, dim=-1))
    probs = torch.exp(kept_values - total.unsqueeze(1))
    mass = torch.cumsum(probs, dim=-1)
    drop = k_cut | ((mass - probs >= p.unsqueeze(1)) & (ranks > 0) & cut.unsqueeze(1))
    filtered.index_copy_(0, partial, torch.full_like(rows, float("-inf")).scatter_(
        -1, order, values.masked_fill(drop, float("-inf"))))
    # Sorted whole: rows with a top-k past the candidates, and rows whose nucleus reaches past them
    # (neither cut ends within the candidates, so tokens after them would be kept too; a row that
    # asks for neither keeps every token).
    whole = torch.ones(logits.shape[0], dtype=torch.bool)
    whole[partial] = ~within_k & (~cut | (mass[:, -1] < p))
    if bool(whole.any()):
        rows_sorted = whole.nonzero().squeeze(1)
        filtered.index_copy_(0, rows_sorted, _filter_sorted(logits.index_select(0, rows_sorted),
                                                            top_k.index_select(0, rows_sorted),
                                                            top_p.index_select(0, rows_sorted)))
    return filtered


def _filter_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`filter_top_k_top_p` by a sort of every row."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    cuts = (top_p < 1.0).unsqueeze(1)  # (a mass rounded up to 1.0 must not cut a row that asks for no top-p)
    drop = drop | ((mass_before >= top_p.unsqueeze(1)) & (ranks > 0) & cuts)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
