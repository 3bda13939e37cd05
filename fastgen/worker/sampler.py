"""Turns a batch's logits into next tokens, each row with its own request's settings.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with
probability p_i. The noise is drawn outside the (compilable) arithmetic, so each request can
draw it from its own seeded generator and its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence as Seq

import torch

from fastgen.checks import FLOAT32_MAX
from fastgen.engine.sequence import Sequence


class Sampler:
    """Builds the per-row parameter tensors and noise, then calls the (compiled) sample function.

    Greedy rows draw no noise. Rows whose request has a seed draw from that request's own
    generator, created on its first sampled token and kept here, by sequence id, until the
    request finishes (`release`), so a seeded request reproduces exactly whatever else shares
    its batches, preemptions included; the others share the engine's generator.
    """

    def __init__(self, vocab_size: int, device: torch.device, seed: int, sample_fn: Callable):
        self.vocab_size = vocab_size
        self.device = device
        self.sample_fn = sample_fn
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.request_generators: dict[int, torch.Generator] = {}

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget the generators of requests that finished."""
        for seq_id in seq_ids:
            self.request_generators.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        """logits: [B, V] (any float dtype) for the rows of `seqs`; returns int64 [B] on device."""
        logits = logits.float()
        params = [s.params for s in seqs]
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1)
        vocab = logits.shape[-1]
        temps = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
        # A top_k at or above the vocabulary keeps every token: clamped here, so any integer a
        # request may carry fits the int64 tensor.
        top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], dtype=torch.int64)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        needs_filter = any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params)
        noise = self._noise(seqs, vocab)
        return self.sample_fn(
            logits,
            temps.to(self.device, non_blocking=True),
            top_k.to(self.device, non_blocking=True),
            top_p.to(self.device, non_blocking=True),
            noise,
            needs_filter,
        )

    def _noise(self, seqs: Seq[Sequence], vocab: int) -> torch.Tensor:
        noise = torch.empty(len(seqs), vocab, device=self.device)
        noise.exponential_(generator=self.generator)
        for row, seq in enumerate(seqs):
            if seq.params.seed is None or seq.params.greedy:
                continue
            generator = self.request_generators.get(seq.seq_id)
            if generator is None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(seq.params.seed)  # in range: SamplingParams checked it
                self.request_generators[seq.seq_id] = generator
            noise[row].exponential_(generator=generator)
        return noise


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    noise: torch.Tensor,
    filter_top_k_top_p: bool,
) -> torch.Tensor:
    """Pick one token per row (a pure function of tensors, so torch.compile can fuse it).

    logits: float32 [B, V]. temperatures: float32 [B], 0 means greedy. top_k: int64 [B], V when
    disabled. top_p: float32 [B], 1.0 when disabled. noise: float32 [B, V] of Exp(1) draws.
    filter_top_k_top_p: False skips the sort when no row asks for top-k or top-p.
    Returns int64 [B].
    """
    greedy = logits.argmax(dim=-1)
    safe_t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    # Finite logits over a small temperature can overflow to inf, and inf - inf is NaN in the
    # softmax: keep every scaled logit finite.
    scaled = (logits / safe_t.unsqueeze(1)).clamp(min=-FLOAT32_MAX, max=FLOAT32_MAX)
    if filter_top_k_top_p:
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(temperatures > 0, sampled, greedy)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k and outside its top-p nucleus.

    The nucleus keeps the smallest prefix of the sorted tokens whose mass reaches top_p. The most
    likely token always survives (top_k >= 1, and rank 0 is exempt from the top-p cut: a top_p
    that is 0 in float32 would otherwise drop every token and leave a row of NaN).
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop = drop | ((mass_before >= top_p.unsqueeze(1)) & (ranks > 0))
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
