"""Turns a batch's logits into next tokens, each row with its own request's settings.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with
probability p_i. The noise is drawn outside the (compilable) arithmetic, so each request can
draw it from its own seeded generator and its tokens do not depend on what else is in the batch.

Before any row is sampled (greedy rows too), each request's logit_bias is added, the tokens its
grammar does not allow are masked (structured outputs: the step's `GrammarBitmask`), min_tokens
bans end-of-sequence and stop tokens (not in rows that follow a grammar: the grammar decides where
they end) and the penalties are applied (`compile/sampling_ops.py`, over `worker/penalties.py`'s device token
counts), in vLLM's order; min_p then filters after
temperature, before top-k/top-p. The whole batch, whatever mix of settings, is one call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

import torch

from fastgen.compile.sampling_ops import NucleusFilter, apply_penalties
from fastgen.scheduler_output import GrammarBitmask
from fastgen.sequence import Sequence
from fastgen.worker.penalties import TokenCounts
from fastgen.worker.token_bitmask import mask_disallowed


class Sampler:
    """Builds the per-row parameter tensors and noise, then calls the (compiled) sample function.

    Greedy rows draw no noise. Rows whose request has a seed draw from that request's own
    generator, created on its first sampled token and kept here, by sequence id, until the
    request finishes (`release`), seeded afresh for each output position from the request's
    seed and the position: so a seeded request reproduces exactly whatever else shares its
    batches, preemptions included, and whichever step samples a position (speculative
    decoding's verify steps sample several positions at once, some of them twice over when a
    draft was rejected, and give the same tokens as one position a step); the others share the
    engine's generator.

    Requests with penalties also get a slot in `token_counts`, filled from their tokens when they
    first sample and counted on the device after every call. eos_token_ids: what min_tokens bans
    (with each request's stop_token_ids) unless the request ignores EOS.
    """

    def __init__(self, vocab_size: int, device: torch.device, seed: int, sample_fn: Callable,
                 penalty_fn: Callable = apply_penalties, eos_token_ids: Iterable[int] = ()):
        self.vocab_size = vocab_size
        self.device = device
        self.sample_fn = sample_fn
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(generator_seed(seed, device))
        self.request_generators: dict[int, torch.Generator] = {}
        self.logit_biases: dict[int, tuple[dict, torch.Tensor, torch.Tensor]] = {}  # by sequence id: _bias_of
        self.penalty_fn = penalty_fn
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.token_counts = TokenCounts(vocab_size, device)

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget the generators, logit biases and token counts of requests that finished."""
        seq_ids = tuple(seq_ids)
        for seq_id in seq_ids:
            self.request_generators.pop(seq_id, None)
            self.logit_biases.pop(seq_id, None)
        self.token_counts.release(seq_ids)

    def release_token_counts(self, seq_ids: Iterable[int]) -> None:
        """Preempted sequences: their counts are refilled from their tokens when they sample again
        (their generators stay: a seeded request must go on drawing where it left off)."""
        self.token_counts.release(seq_ids)

    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence], greedy_tokens: torch.Tensor | None = None,
                 grammar: GrammarBitmask | None = None, offsets: Seq[int] | None = None) -> torch.Tensor:
        """logits: [B, V] (any float dtype) for the rows of `seqs`, left unchanged; returns int64
        [B] on device.

        greedy_tokens: logits.argmax(-1) when already computed (a decode graph does it in the
        graph); used when no row's logits change here (no bias, grammar, penalties or min_tokens
        bans), so an all-greedy batch then launches nothing. grammar: the token masks of the rows
        whose sequence follows a grammar. offsets: row i samples its sequence's output token
        num_output_tokens + offsets[i] (None: all 0; speculative decoding's drafted positions
        are 1, 2, ...).
        """
        processed, penalised = self._process(self._bias_and_mask(logits, seqs, grammar), seqs)
        if processed is not logits:
            greedy_tokens = None  # the argmax was taken before the bias, masks, penalties and bans
        tokens = self._sample(processed, seqs, greedy_tokens, offsets)
        if penalised is not None:
            rows, slots = penalised
            self.token_counts.count(slots, tokens.index_select(0, rows))
        return tokens

    def _bias_and_mask(self, logits: torch.Tensor, seqs: Seq[Sequence], grammar: GrammarBitmask | None
                       ) -> torch.Tensor:
        """logit_bias added, then the grammar's disallowed tokens set to -inf (the same tensor
        when no row has either)."""
        biased = [(row, self._bias_of(seq)) for row, seq in enumerate(seqs) if seq.params.logit_bias]
        if biased:
            rows = torch.repeat_interleave(torch.tensor([row for row, _ in biased], dtype=torch.int64),
                                           torch.tensor([len(cols) for _, (cols, _) in biased]))
            cols = torch.cat([cols for _, (cols, _) in biased])
            values = torch.cat([values for _, (_, values) in biased]).to(self.device, non_blocking=True)
            index = torch.stack([rows, cols]).to(self.device, non_blocking=True)
            logits = logits.float().index_put((index[0], index[1]), values, accumulate=True)
        if grammar is None or not grammar.seq_ids:
            return logits
        position = {seq_id: i for i, seq_id in enumerate(grammar.seq_ids)}
        masked = [(row, position[seq.seq_id]) for row, seq in enumerate(seqs) if seq.seq_id in position]
        if not masked:
            return logits
        bitmask = grammar.fill()
        order = [i for _, i in masked]
        if order != list(range(bitmask.shape[0])):
            bitmask = bitmask.index_select(0, torch.tensor(order, dtype=torch.int64))
        rows = [row for row, _ in masked]
        rows_t = None if rows == list(range(len(seqs))) else torch.tensor(rows, dtype=torch.int64).to(
            self.device, non_blocking=True)
        return mask_disallowed(logits, rows_t, bitmask.to(self.device, non_blocking=True))

    def _bias_of(self, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's logit_bias as (token ids int64, biases float32) host tensors, made on its
        first step and kept until it finishes: a map of up to 1,024 entries is not walked again
        every step."""
        entries = seq.params.logit_bias
        cached = self.logit_biases.get(seq.seq_id)
        if cached is None or cached[0] is not entries:  # (a sequence id met again with other settings)
            cached = self.logit_biases[seq.seq_id] = (entries, torch.tensor(list(entries), dtype=torch.int64),
                                                      torch.tensor(list(entries.values()), dtype=torch.float32))
        return cached[1], cached[2]

    def _process(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> tuple[torch.Tensor, tuple | None]:
        """min_tokens' bans, then the penalties; returns the new logits (the same tensor when no
        row is touched) and, when rows were penalised, (rows, their slots) as int64 device
        tensors, for counting their tokens."""
        rows, cols = [], []
        for row, seq in enumerate(seqs):
            p = seq.params
            if output_position(seq) < p.min_tokens and p.structured_outputs is None:
                banned = p.stop_token_ids if p.ignore_eos else [*p.stop_token_ids, *self.eos_token_ids]
                rows += [row] * len(banned)
                cols += banned
        if rows:
            index = torch.tensor([rows, cols], dtype=torch.int64).to(self.device, non_blocking=True)
            banned_value = torch.full((), float("-inf"), device=logits.device)
            logits = logits.float().index_put((index[0], index[1]), banned_value)
        penalised = [row for row, seq in enumerate(seqs) if seq.params.has_penalties]
        if not penalised:
            return logits, None
        slots = self.token_counts.slots([seqs[row] for row in penalised])
        rows_t = torch.tensor(penalised, dtype=torch.int64).to(self.device, non_blocking=True)
        values = torch.tensor([[seqs[r].params.repetition_penalty, seqs[r].params.frequency_penalty,
                                seqs[r].params.presence_penalty] for r in penalised], dtype=torch.float32)
        rep, freq, pres = values.to(self.device, non_blocking=True).unbind(1)
        counts = self.token_counts
        logits = self.penalty_fn(logits.float(), rows_t, slots, counts.output_counts, counts.prompt_mask,
                                 rep, freq, pres)
        return logits, (rows_t, slots)

    def _sample(self, logits: torch.Tensor, seqs: Seq[Sequence], greedy_tokens: torch.Tensor | None,
                offsets: Seq[int] | None = None) -> torch.Tensor:
        sampled = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
        if len(sampled) < len(seqs):
            # argmax of the model-dtype logits: widening to fp32 is exact, so it picks the same
            # token (the first of any tie) without materialising a float copy.
            tokens = greedy_tokens if greedy_tokens is not None else logits.argmax(dim=-1)
            if not sampled:
                return tokens
            # Only the rows that sample are scaled, filtered and raced: a batch of greedy requests
            # must not pay for the vocabulary-wide work of the one that samples.
            rows = torch.tensor(sampled, dtype=torch.int64).to(self.device, non_blocking=True)
            picked = self._sample_rows(logits.index_select(0, rows), [seqs[row] for row in sampled],
                                       None if offsets is None else [offsets[row] for row in sampled])
            return tokens.index_copy(0, rows, picked)
        return self._sample_rows(logits, seqs, offsets)

    def _sample_rows(self, logits: torch.Tensor, seqs: Seq[Sequence], offsets: Seq[int] | None) -> torch.Tensor:
        """Tokens for rows whose requests all sample (temperature > 0)."""
        params = [s.params for s in seqs]
        logits = logits.float()
        vocab = logits.shape[-1]
        # A top_k at or above the vocabulary keeps every token: clamped here, so any integer a
        # request may carry fits the int64 tensor.
        top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
        filtered = [row for row, p in enumerate(params) if top_k[row] < vocab or p.top_p < 1.0]
        nucleus = None
        if filtered:
            every = len(filtered) == len(params)
            nucleus = NucleusFilter(
                rows=None if every else torch.tensor(filtered, dtype=torch.int64).to(self.device, non_blocking=True),
                top_k=torch.tensor([top_k[row] for row in filtered], dtype=torch.int64).to(self.device,
                                                                                          non_blocking=True),
                top_p=torch.tensor([params[row].top_p for row in filtered], dtype=torch.float32).to(
                    self.device, non_blocking=True),
            )
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        return self.sample_fn(
            logits,
            temps.to(self.device, non_blocking=True),
            self._noise(seqs, vocab, offsets),
            nucleus,
            min_p.to(self.device, non_blocking=True),
            any(p.min_p > 0.0 for p in params),
        )

    def _noise(self, seqs: Seq[Sequence], vocab: int, offsets: Seq[int] | None = None) -> torch.Tensor:
        """Exp(1) draws [len(seqs), V] for rows that all sample, each drawn once: a seeded
        request's row from its own generator, the others' from the engine's."""
        noise = torch.empty(len(seqs), vocab, device=self.device)
        shared = [row for row, seq in enumerate(seqs) if seq.params.seed is None]
        if len(shared) == len(seqs):
            draw_exponential(noise, self.generator)
        elif shared:
            rows = torch.tensor(shared, dtype=torch.int64).to(self.device, non_blocking=True)
            noise.index_copy_(0, rows, draw_exponential(torch.empty(len(shared), vocab, device=self.device),
                                                        self.generator))
        for row, seq in enumerate(seqs):
            if seq.params.seed is None:
                continue
            generator = self.request_generators.get(seq.seq_id)
            if generator is None:
                generator = self.request_generators[seq.seq_id] = torch.Generator(device=self.device)
            position = output_position(seq) + (offsets[row] if offsets is not None else 0)
            generator.manual_seed(generator_seed(position_seed(seq.params.seed, position), self.device))
            draw_exponential(noise[row], generator)
        return noise


def draw_exponential(out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill `out` with Exp(1) draws from `generator`; returns it. On the CPU as -log(U) of float64
    uniform draws (U = 0 taken as the smallest positive double: an infinite draw would zero a row
    whose one allowed token then loses to a banned one), twice to four times cheaper there than
    torch's `exponential_`, and without float32's 2**-24 steps between small draws; elsewhere
    torch's own, one kernel."""
    if out.device.type == "cpu":
        uniform = torch.rand(out.shape, generator=generator, dtype=torch.float64)
        return out.copy_(uniform.clamp_(min=_SMALLEST_DOUBLE).log_().neg_())
    return out.exponential_(generator=generator)


_SMALLEST_DOUBLE = torch.finfo(torch.float64).tiny


def output_position(seq: Sequence) -> int:
    """The output position a step samples for `seq` (during the step, which counts its sample as
    pending): its output tokens, and any sampled by an earlier launched step that the host has
    not read yet (overlap scheduling)."""
    return seq.num_output_tokens + max(seq.num_pending_tokens - 1, 0)


def position_seed(seed: int, position: int) -> int:
    """A seeded request's generator seed for its output token `position`: the request's seed
    (in [0, 2**64), as SamplingParams checks) mixed with the position by a 64-bit odd multiplier,
    so neighbouring positions and seeds get unrelated streams."""
    return (seed ^ ((position + 1) * 0x9E3779B97F4A7C15)) & 0xFFFF_FFFF_FFFF_FFFF


_MASK64 = 0xFFFF_FFFF_FFFF_FFFF


def generator_seed(seed: int, device: torch.device) -> int:
    """`seed` (in [0, 2**64)) as a torch.Generator on `device` should take it. The CPU's
    generator (mt19937) keeps only a seed's low 32 bits, so seeds that differ above bit 31 would
    sample alike: there the 64 bits are mixed (splitmix64's finalizer) and folded into 32."""
    if device.type != "cpu":
        return seed
    z = ((seed ^ (seed >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z ^ (z >> 32)) & 0xFFFF_FFFF
