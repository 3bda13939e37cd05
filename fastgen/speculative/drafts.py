"""Which sequences propose draft tokens, and how many.

A sequence drafts only where verifying its drafts is exact with the sampler as it is: no
penalties (they would count each drafted token before it is accepted), no grammar (its matcher
advances one accepted token at a time), no logprobs (they are read for the last sampled row
only) and past min_tokens (whose bans depend on the position). Such requests decode one token a
step, exactly as without speculation.

Drafts that keep failing cost a verify step each for nothing, so a sequence whose recent
verifications accepted on average fewer than MIN_MEAN_ACCEPTED tokens stops proposing for a
while (8 steps, doubling each time up to 256), and starts again after: text turns repetitive
and back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import numpy as np

from fastgen.sequence import Sequence
from fastgen.speculative.config import SpeculativeConfig
from fastgen.speculative.ngram import lookup_draft

WINDOW = 8  # verifications a sequence's recent acceptance is judged on
MIN_MEAN_ACCEPTED = 0.5
FIRST_BACKOFF, MAX_BACKOFF = 8, 256


class _SequenceDrafts:
    """One sequence's token buffer (grown as its tokens are) and back-off."""

    def __init__(self, prediction: list[int] | None):
        self.tokens = np.empty(0, dtype=np.int64)
        self.filled = 0
        self.prediction = None if not prediction else np.asarray(prediction, dtype=np.int64)
        self.recent: deque[int] = deque(maxlen=WINDOW)
        self.pause_steps = 0
        self.backoff = FIRST_BACKOFF

    def sync(self, token_ids: list[int]) -> np.ndarray:
        n = len(token_ids)
        if n < self.filled:  # never grows back shorter; rebuilt to be safe
            self.filled = 0
        if n > self.tokens.shape[0]:
            grown = np.empty(max(n, 2 * self.tokens.shape[0], 256), dtype=np.int64)
            grown[: self.filled] = self.tokens[: self.filled]
            self.tokens = grown
        if n > self.filled:
            self.tokens[self.filled:n] = token_ids[self.filled:n]
            self.filled = n
        return self.tokens[:n]


class Drafter:
    """Proposes draft tokens for decoding sequences (`propose`) and learns from their
    verification (`record`). prediction_of: a sequence's predicted output tokens (OpenAI's
    `prediction`), searched before its own tokens; None for none."""

    def __init__(self, config: SpeculativeConfig,
                 prediction_of: Callable[[Sequence], list[int] | None] = lambda seq: None):
        self.config = config
        self.prediction_of = prediction_of
        self.seqs: dict[int, _SequenceDrafts] = {}

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        p = seq.params
        return (not p.has_penalties and p.structured_outputs is None and p.logprobs is None
                and seq.num_output_tokens >= p.min_tokens)

    def propose(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        """At most min(limit, num_speculative_tokens) draft tokens to follow the sequence's
        tokens; () when it does not speculate this step."""
        limit = min(limit, self.config.num_speculative_tokens)
        if limit <= 0 or not self.eligible(seq):
            return ()
        state = self.seqs.get(seq.seq_id)
        if state is None:
            state = self.seqs[seq.seq_id] = _SequenceDrafts(self.prediction_of(seq))
        if state.pause_steps > 0:
            state.pause_steps -= 1
            return ()
        cfg = self.config
        tokens = state.sync(seq.token_ids)
        prediction = state.prediction
        if prediction is not None:
            # While the output follows the prediction from its start, the prediction goes on.
            done = seq.num_output_tokens
            if done < prediction.shape[0] and np.array_equal(tokens[seq.num_prompt_tokens:], prediction[:done]):
                return tuple(prediction[done: done + limit].tolist())
        return tuple(lookup_draft(tokens, prediction, limit, cfg.prompt_lookup_max, cfg.prompt_lookup_min))

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verification of `proposed` draft tokens of which the first `accepted` were kept."""
        state = self.seqs.get(seq.seq_id)
        if state is None or proposed == 0:
            return
        state.recent.append(accepted)
        if len(state.recent) == WINDOW:
            if sum(state.recent) / WINDOW < MIN_MEAN_ACCEPTED:
                state.pause_steps = state.backoff
                state.backoff = min(2 * state.backoff, MAX_BACKOFF)
                state.recent.clear()
            else:
                state.backoff = FIRST_BACKOFF

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self.seqs.pop(seq_id, None)
