"""Turns a batch's logits into next tokens, each row with its own request's settings."""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq

import torch

from fastgen.sequence import Sequence


class Sampler:
    """Builds the per-row parameter tensors and noise, then calls the (compiled) sample function.

    Greedy rows draw no noise. Rows whose request has a seed draw from that request's own
    generator (created on first use and kept on the sequence), so a seeded request reproduces
    exactly whatever else shares its batches; the others share the engine's generator.
    """

    def __init__(self, vocab_size: int, device: torch.device, seed: int, sample_fn: Callable):
        self.vocab_size = vocab_size
        self.device = device
        self.sample_fn = sample_fn
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        """logits: [B, V] (any float dtype) for the rows of `seqs`; returns int64 [B] on device."""
        logits = logits.float()
        params = [s.params for s in seqs]
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1)
        vocab = logits.shape[-1]
        temps = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], dtype=torch.int64)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        needs_filter = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
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
            if seq.generator is None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(seq.params.seed)  # in range: SamplingParams checked it
                seq.generator = generator
            noise[row].exponential_(generator=seq.generator)
        return noise
