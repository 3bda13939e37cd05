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
    disabled; top_p: float32 [R], 1.0 when disabled. largest_top_k: the largest top_k below V
    among them (0: none), known on the host so that choosing the candidates reads nothing back.
    """

    rows: torch.Tensor | None
    top_k: torch.Tensor
    top_p: torch.Tensor
    largest_top_k: int


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
            scaled = filter_top_k_top_p(scaled, nucleus.top_k, nucleus.top_p, nucleus.largest_top_k)
        else:
            picked = filter_top_k_top_p(scaled.index_select(0, nucleus.rows), nucleus.top_k, nucleus.top_p,
                                        nucleus.largest_top_k)
            scaled = scaled.index_copy(0, nucleus.rows, picked)
    return (pick or pick_tokens)(logits, scaled, temperatures, noise)


def scale_logits(logits: torch.Tensor, temperatures: torch.Tensor, min_p: torch.Tensor | None,
                 filter_min_p: bool) -> torch.Tensor:
    """Logits over each row's temperature (greedy rows: 1), with min_p's cut applied as -inf."""
    safe_t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    # Finite logits over a small temperature can overflow to inf, and inf - inf is NaN in the
    # softmax: keep every scaled logit finite.
    scaled = (logits / safe_t.unsqueeze(1)).clamp(min=-FLOAT32_MAX, max=FLOAT32_MAX)
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


# How many of a row's most likely tokens the CPU's top-p filter looks at first (a partial top-k
# instead of a sort of the whole vocabulary, several times its cost); a row whose nucleus they do
# not hold is sorted whole.
TOP_P_CANDIDATES = 256


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       largest_top_k: int | None = None) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k and outside its top-p nucleus.

    The nucleus keeps the smallest prefix of the tokens by likelihood whose mass (after the
    top-k cut) reaches top_p. The most likely token always survives (top_k >= 1, and rank 0 is
    exempt from the top-p cut: a top_p that is 0 in float32 would otherwise drop every token
    and leave a row of NaN). largest_top_k: the largest top_k below V in `top_k` (0: none; None:
    unknown, read from the tensor).

    On the CPU the rows' most likely tokens are found by a partial top-k first (top-k alone never
    needs more; top-p rarely does), and only rows whose nucleus reaches past them are sorted
    whole; the answer is the same either way. On a GPU the sort is cheap, and learning which rows
    need it would make the host wait for the device: every row is sorted.
    """
    vocab = logits.shape[-1]
    if largest_top_k is None:
        below = top_k[top_k < vocab]
        largest_top_k = int(below.max()) if below.numel() else 0
    candidates = max(TOP_P_CANDIDATES, largest_top_k)
    if logits.device.type != "cpu" or 2 * candidates >= vocab:
        return _filter_sorted(logits, top_k, top_p)
    values, order = logits.topk(candidates, dim=-1)  # sorted, most likely first
    ranks = torch.arange(candidates, device=logits.device).unsqueeze(0)
    k_cut = ranks >= top_k.unsqueeze(1)
    within = top_k <= candidates  # rows whose top-k cut leaves only candidates
    kept_values = values.masked_fill(k_cut, float("-inf"))
    # The nucleus is measured against what survives top-k: the candidates alone where the cut
    # leaves nothing else, the whole row otherwise.
    total = torch.where(within, torch.logsumexp(kept_values, dim=-1), torch.logsumexp(logits, dim=-1))
    probs = torch.exp(kept_values - total.unsqueeze(1))
    mass = torch.cumsum(probs, dim=-1)
    cuts = top_p < 1.0  # (a mass rounded up to 1.0 must not cut a row that asks for no top-p)
    drop = k_cut | ((mass - probs >= top_p.unsqueeze(1)) & (ranks > 0) & cuts.unsqueeze(1))
    # Where neither cut reaches past the candidates, the tokens after them would be kept too.
    incomplete = ~within & (~cuts | (mass[:, -1] < top_p))
    filtered = torch.full_like(logits, float("-inf")).scatter_(-1, order, values.masked_fill(drop, float("-inf")))
    if bool(incomplete.any()):
        rows = incomplete.nonzero().squeeze(1)
        whole = _filter_sorted(logits.index_select(0, rows), top_k.index_select(0, rows), top_p.index_select(0, rows))
        filtered.index_copy_(0, rows, whole)
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
