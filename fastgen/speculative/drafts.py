"""Which sequences propose draft tokens, and how many.

A sequence drafts only where verifying its drafts is exact with the sampler as it is: no
penalties (they would count each drafted token before it is accepted), no grammar (its matcher
advances one accepted token at a time), no logprobs (they are read for the last sampled row
only) and past min_tokens (whose bans depend on the position). Such requests decode one token a
step, exactly as without speculation.

How many: a drafted token costs a row of every product and of the LM head in its step; a kept
one saves its sequence a step, worth S(B) / B for a step of B sequences that costs S(B). Alone
in its step a row costs about a tenth of the step (`row_cost`, by device), so a drafted token
pays where it is kept one time in ten; as the batch grows the step turns compute-bound, each
sequence's share of it shrinks, and a drafted token must be kept more and more often to pay
(`pay_threshold`: a third at 4 sequences, four fifths at 16, on a CPU). The i-th token of a
draft is kept with probability about a**i, a being the sequence's recent rate of kept drafted
tokens (the tokens kept over those checked, a checked token being each kept one and the first
rejected one, discounted so that recent verifications count most; starting from a prior of
PRIOR_RATE), so a sequence drafts the tokens i with a**i above the threshold, at most
num_speculative_tokens: long drafts for copied text, short ones as the batch grows or the text
stops repeating, none once a token would not pay.

The threshold is measured where it can be: the engine reports every step that computed no
prompt token (`observe_step`), and per batch size the drafter keeps the median of the recent
steps without drafts and of the extra time per drafted token in recent steps with them (a
median, so that one slow step, a collection or the first of its shape, does not set the
threshold for many steps after it); once a few of each were seen, their ratio to a kept
token's worth is the threshold. The model above is only the start (it
was fitted to bf16 weights on a CPU; quantized weights make a verify step dearer, a GPU's
eager verify steps far dearer).

A draft found by a match of one token (prompt_lookup_min 1) is weaker evidence than one found by
a longer match: a common token occurs all over the text, and what followed it somewhere is
seldom what follows it now. Such drafts have a rate of their own (`weak_rate`, from the same
prior, learning from their own verifications), so a sequence drafts after a one-token match
only while those drafts are kept often enough to pay at the step's batch size: after a text's
corrected word (whose next tokens no longer match the prompt for two tokens in a row) where they
pay, seldom in free text, and not in a large batch, while its longer matches keep the rate they
earned. A rate too low to pay makes no drafts to learn from, so each verification that keeps
tokens of a longer match (the sequence copies again) moves it a step back towards the prior.
Lookups start near the sequence's copy cursor, where its last draft would have gone on
(`fastgen.speculative.ngram`).

A sequence whose rate has fallen below paying for even one token would never draft again to
learn better, so after FIRST_BACKOFF steps without drafts it tries one token (then waits twice
as long after each failed try, up to MAX_BACKOFF steps; a kept try resets the wait): text turns
repetitive and back. A try makes its whole step a verify step, so in a step of B sequences the
waits are B times longer, and the longest where the measured threshold is near 1.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from fastgen.sequence import Sequence
from fastgen.speculative.config import SpeculativeConfig
from fastgen.speculative.ngram import lookup_draft

if TYPE_CHECKING:
    from fastgen.speculative.draft_model import DraftModelProposer

PRIOR_RATE = 0.5  # a sequence's rate of kept draft tokens before any verification
PRIOR_WEIGHT = 1.0  # the prior counts as this many checked tokens
DISCOUNT = 0.8  # weight of earlier verifications' counts at each new one
FIRST_BACKOFF, MAX_BACKOFF = 8, 256
MAX_THRESHOLD_FOR_TRIES = 0.9  # a measured threshold this high: tries only after the longest wait
# Lookups in a row that found nothing, after which a sequence whose rate pays waits as one whose
# rate does not: text that never repeats would otherwise look up every step (and, with overlap
# scheduling, keep every step in turn for a draft that never comes).
MISSES_BEFORE_WAITING = FIRST_BACKOFF
# A drafted row's cost relative to a one-sequence decode step, by device: measured on a 2-core
# CPU for a 135M model in bf16 (about 1.5 ms a row against 15 ms a step). On CUDA a verify step
# that a verify graph runs ("cuda-graphs") streams the weights once as a decode step does, a row
# a small share of it; one verified eagerly (no graph fits it, or graphs are off) costs many
# times a replayed step: a guess that makes a draft pay only when kept about two times in three
# alone in its step. Each is the start until the engine has measured its own verify steps.
ROW_COST = {"cpu": 0.1, "cuda-graphs": 0.1, "cuda": 1.0}


def pay_threshold(row_cost: float, batch_size: int) -> float:
    """The probability above which a drafted token pays in a step of `batch_size` sequences:
    about row_cost alone in the step, rising towards 1 as the batch makes the step compute-bound
    (1 - exp(-row_cost * B): a third at 4 sequences and four fifths at 16 on a CPU, a little above
    the break-even measured there, 0.38 and 0.67)."""
    return 1.0 - math.exp(-row_cost * batch_size)


class _SequenceDrafts:
    """One sequence's token buffer (grown as its tokens are), rates of kept drafts (after longer
    matches, and after one-token ones), back-off and copy cursor."""

    def __init__(self, prediction: list[int] | None):
        self.tokens = np.empty(0, dtype=np.int64)
        self.filled = 0
        self.prediction = None if not prediction else np.asarray(prediction, dtype=np.int64)
        # Discounted drafted tokens kept, and checked (kept, and the first rejected), starting
        # from the prior's, which fade like any earlier verification's.
        self.kept = PRIOR_RATE * PRIOR_WEIGHT
        self.checked = PRIOR_WEIGHT
        self.idle_steps = 0  # steps since the last draft, while the rate is too low to draft
        self.backoff = FIRST_BACKOFF
        self.trying = False  # the last draft was a try made despite the rate
        self.misses = 0  # prompt lookups in a row that found nothing
        # The same counts for drafts found by a match of one token, and whether the last draft was one.
        self.weak_kept = PRIOR_RATE * PRIOR_WEIGHT
        self.weak_checked = PRIOR_WEIGHT
        self.weak = False
        # Where the last lookup draft started in the tokens, and where the sequence's copying
        # would go on (`fastgen.speculative.ngram`): that start plus the tokens kept, plus one.
        self.source: int | None = None
        self.cursor: int | None = None

    @property
    def rate(self) -> float:
        return self.kept / self.checked

    @property
    def weak_rate(self) -> float:
        return self.weak_kept / self.weak_checked

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


def batch_bucket(batch_size: int) -> int:
    """Batch sizes measured together: each up to 8, then powers of two."""
    return batch_size if batch_size <= 8 else 1 << (batch_size - 1).bit_length()


STEP_WINDOW = 16  # recent steps of a kind and batch bucket whose median is taken
MIN_STEPS = 3  # steps of each kind seen before the measurement replaces the model


class _RecentMedian:
    """The median of the last STEP_WINDOW values added; None until MIN_STEPS were."""

    def __init__(self) -> None:
        self.values: deque[float] = deque(maxlen=STEP_WINDOW)
        self.median: float | None = None

    def add(self, value: float) -> None:
        self.values.append(value)
        if len(self.values) >= MIN_STEPS:
            self.median = statistics.median(self.values)


def paying_length(rate: float, threshold: float, most: int) -> int:
    """The longest draft whose every token is kept with probability (rate**i) >= threshold."""
    if threshold <= 0 or rate >= 1.0:
        return most
    if rate <= 0.0 or rate < threshold:
        return 0
    return min(most, int(math.log(threshold) / math.log(rate) + 1e-9))


class Drafter:
    """Proposes draft tokens for decoding sequences (`propose_batch`) and learns from their
    verification (`record`). prediction_of: a sequence's predicted output tokens (OpenAI's
    `prediction`), searched before its own tokens; None for none. row_cost: a drafted token's
    cost relative to a decode step (ROW_COST, by device; plus a draft model's step, with one).
    model: the draft model that proposes where the prediction does not (None: prompt lookup)."""

    def __init__(self, config: SpeculativeConfig, row_cost: float = ROW_COST["cpu"],
                 prediction_of: Callable[[Sequence], list[int] | None] = lambda seq: None,
                 model: DraftModelProposer | None = None):
        self.config = config
        self.model = model  # the draft model (method "draft_model"), else prompt lookup
        self.row_cost = row_cost
        self.prediction_of = prediction_of
        self.seqs: dict[int, _SequenceDrafts] = {}
        self.decode_seconds: dict[int, _RecentMedian] = {}  # batch bucket -> steps without drafts
        self.draft_seconds: dict[int, _RecentMedian] = {}  # batch bucket -> extra time per drafted token
        # Set by the scheduler when it cut drafts to the blocks it had (`observe_step` reads it).
        self.drafts_cut = False

    def observe_step(self, num_decodes: int, num_draft_tokens: int, seconds: float) -> None:
        """A step that decoded `num_decodes` sequences, verified `num_draft_tokens` drafted
        tokens and computed no prompt token took `seconds`."""
        if num_decodes <= 0:
            return
        cut, self.drafts_cut = self.drafts_cut, False
        prefilled = self.model is not None and self.model.prefilled_history
        if prefilled:
            self.model.prefilled_history = False
        if cut:
            return  # drafts were cut after they were made (no blocks): the step paid for more
        if prefilled:
            # A sequence's history prefilled in the draft model: a cost paid once a sequence (or
            # after a long pause), which would make drafting look dear for many steps.
            return
        bucket = batch_bucket(num_decodes)
        decode = self.decode_seconds.setdefault(bucket, _RecentMedian())
        if not num_draft_tokens:
            decode.add(seconds)
        elif decode.median is not None:
            extra = max(0.0, seconds - decode.median) / num_draft_tokens
            self.draft_seconds.setdefault(bucket, _RecentMedian()).add(extra)

    def threshold(self, batch_size: int) -> float:
        """The probability above which a drafted token pays in a step of `batch_size` sequences:
        measured (a drafted token's extra time over a kept token's worth, a step's time over its
        sequences) once MIN_STEPS steps of this size with drafts and without were seen, else
        modelled."""
        bucket = batch_bucket(batch_size)
        if self._measured(bucket):
            return min(1.0, self.draft_seconds[bucket].median * batch_size / self.decode_seconds[bucket].median)
        return pay_threshold(self.row_cost, batch_size)

    def _measured(self, bucket: int) -> bool:
        """Whether steps of this batch bucket with and without drafts were seen enough to measure."""
        draft = self.draft_seconds.get(bucket)
        return draft is not None and draft.median is not None

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        p = seq.params
        return (not p.has_penalties and p.structured_outputs is None and p.logprobs is None
                and seq.num_output_tokens >= p.min_tokens)

    def propose(self, seq: Sequence, limit: int, batch_size: int = 1) -> tuple[int, ...]:
        """Draft tokens to follow one sequence's tokens, at most `limit` (its room in the step)
        and what pays in a step of `batch_size` decoding sequences; () when it does not draft."""
        return self.propose_batch([seq], [limit], limit, batch_size)[0]

    def propose_batch(self, seqs: list[Sequence], rooms: list[int], budget: int, batch_size: int | None = None
                      ) -> list[tuple[int, ...]]:
        """Draft tokens for each of `seqs` (the step's decoding sequences, in batch order): each
        at most its room (max_tokens and max_model_len) and what pays in a step of `batch_size`
        (default len(seqs)) sequences, all of them within `budget` tokens, handed out in batch
        order. A draft model runs once for every sequence it drafts for."""
        batch_size = len(seqs) if batch_size is None else batch_size
        if self.model is not None:
            self.model.prefilled_history = False
        threshold = self.threshold(batch_size)
        drafts: list[tuple[int, ...]] = [()] * len(seqs)
        for_model: list[tuple[int, int]] = []  # (index, length) the draft model proposes for
        tries = [False] * len(seqs)
        for i, (seq, room) in enumerate(zip(seqs, rooms)):
            length, tries[i] = self._length(seq, min(room, budget), batch_size, threshold)
            # A last token still on the device (overlap scheduling) leaves nothing to look up
            # from: the sequence drafts once it is read (`may_draft` keeps that step in turn).
            if length == 0 or seq.num_pending_tokens:
                continue
            state = self.seqs[seq.seq_id]
            state.weak, state.source = False, None
            draft = self._from_prediction(seq, state, length)
            if draft is None and self.model is not None:
                for_model.append((i, length))
                budget -= length
                continue
            if draft is None:
                draft = self._lookup(seq, state, length, threshold, weak=not tries[i])
                state.misses = 0 if draft else state.misses + 1
                if not draft and tries[i]:  # a try that found nothing: wait longer
                    state.idle_steps = 0
                    state.backoff = min(2 * state.backoff, MAX_BACKOFF)
            drafts[i] = draft
            budget -= len(draft)
        if for_model:
            made = self.model.propose([seqs[i] for i, _ in for_model], [n for _, n in for_model])
            for (i, _), draft in zip(for_model, made):
                drafts[i] = draft
        for seq, draft, trying in zip(seqs, drafts, tries):
            if draft:
                state = self.seqs[seq.seq_id]
                state.trying = trying
                state.idle_steps = 0
        return drafts

    def _length(self, seq: Sequence, limit: int, batch_size: int, threshold: float) -> tuple[int, bool]:
        """How many tokens the sequence drafts (0: none), and whether that is a try: what its
        rate pays for, or one token after its back-off; a step without a draft counts towards
        the back-off."""
        if limit <= 0 or not self.eligible(seq):
            return 0, False
        state = self.seqs.get(seq.seq_id)
        if state is None:
            state = self.seqs[seq.seq_id] = _SequenceDrafts(self.prediction_of(seq))
        length = self._paying(state, threshold)
        if length > 0:
            return min(limit, length), False
        state.idle_steps += 1
        if not self._try_due(state, batch_size, threshold, state.idle_steps):
            return 0, False
        return 1, True  # a try: the rate learns only from drafts

    def _paying(self, state: _SequenceDrafts, threshold: float) -> int:
        """The draft length the sequence's rate pays for (0 after too many lookups in a row
        that found nothing)."""
        if state.misses >= MISSES_BEFORE_WAITING:
            return 0
        return paying_length(state.rate, threshold, self.config.num_speculative_tokens)

    def _try_due(self, state: _SequenceDrafts, batch_size: int, threshold: float, idle_steps: int) -> bool:
        """Whether a sequence whose rate pays for no draft tries one after `idle_steps` without."""
        # A try turns its whole step into a verify step, so among B sequences each tries B
        # times less often; where measured steps say no draft pays at this batch size, only
        # after the longest wait (the measurement is refreshed, never trusted for good).
        # A draft model's try also computes what the sequence made since its last draft: where
        # the model says no draft pays, only after the longest wait too.
        wait = state.backoff * batch_size
        if threshold >= MAX_THRESHOLD_FOR_TRIES and (self.model is not None
                                                     or self._measured(batch_bucket(batch_size))):
            wait = MAX_BACKOFF * batch_size
        return idle_steps >= wait

    def may_draft(self, seqs: list[Sequence], batch_size: int) -> bool:
        """Whether any of `seqs` could draft in the next step of `batch_size` decoding sequences
        (its rate pays, or its try is due then), changing nothing. The engine lets a step's
        tokens stay on the device while the next one runs (overlap scheduling) only where none
        could: a draft is looked up from the last token."""
        limit = self.config.disable_by_batch_size
        if limit is not None and batch_size >= limit:  # the scheduler drafts for none of them
            return False
        threshold = self.threshold(batch_size)
        for seq in seqs:
            if seq.is_finished or not self.eligible(seq):
                continue
            # A sequence never drafted for starts from the prior (its prediction, if any, is
            # looked up when it drafts; the pay decision is the rate's alone).
            state = self.seqs.get(seq.seq_id) or _SequenceDrafts(None)
            if self._paying(state, threshold) > 0:
                return True
            if self._try_due(state, batch_size, threshold, state.idle_steps + 1):
                return True
        return False

    def _from_prediction(self, seq: Sequence, state: _SequenceDrafts, length: int) -> tuple[int, ...] | None:
        """The request's predicted output where the output has followed it from its start (what
        the caller said comes next); None otherwise."""
        prediction = state.prediction
        if prediction is None:
            return None
        done = seq.num_output_tokens
        tokens = state.sync(seq.token_ids)
        if done < prediction.shape[0] and np.array_equal(tokens[seq.num_prompt_tokens:], prediction[:done]):
            return tuple(prediction[done: done + length].tolist())
        return None

    def _lookup(self, seq: Sequence, state: _SequenceDrafts, length: int, threshold: float, weak: bool
                ) -> tuple[int, ...]:
        """At most `length` tokens after a match of two tokens or more (`lookup_draft`: near the
        copy cursor, else the latest); else, where the config looks for one (prompt_lookup_min 1)
        and `weak` allows it (not a try, which tests the sequence's own rate), after a one-token
        match as many as the weak rate pays for."""
        cfg = self.config
        tokens = state.sync(seq.token_ids)
        draft, state.source = lookup_draft(tokens, state.prediction, length, cfg.prompt_lookup_max,
                                           max(cfg.prompt_lookup_min, 2), state.cursor)
        if draft or cfg.prompt_lookup_min > 1 or not weak:
            return tuple(draft)
        weak_length = min(length, paying_length(state.weak_rate, threshold, cfg.num_speculative_tokens))
        if weak_length == 0:
            return ()
        draft, state.source = lookup_draft(tokens, state.prediction, weak_length, 1, 1, state.cursor)
        state.weak = bool(draft)
        return tuple(draft)

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verification of `proposed` draft tokens of which the first `accepted` were kept."""
        state = self.seqs.get(seq.seq_id)
        if state is None or proposed == 0:
            return
        checked = accepted + (accepted < proposed)
        if state.source is not None:
            state.cursor = state.source + accepted + 1
        if state.weak:
            state.weak_kept = state.weak_kept * DISCOUNT + accepted
            state.weak_checked = state.weak_checked * DISCOUNT + checked
            return
        if accepted and state.weak_rate < PRIOR_RATE:
            # A kept draft not found by a one-token match (a longer match, or the prediction):
            # the sequence copies again, and its one-token matches (none made while their rate
            # was below paying, so never measured again) may pay again after its next edit: a low
            # one-token rate goes a step back towards the prior.
            state.weak_kept = state.weak_kept * DISCOUNT + PRIOR_RATE * PRIOR_WEIGHT * (1 - DISCOUNT)
            state.weak_checked = state.weak_checked * DISCOUNT + PRIOR_WEIGHT * (1 - DISCOUNT)
        state.kept = state.kept * DISCOUNT + accepted
        state.checked = state.checked * DISCOUNT + checked
        if state.trying:
            state.backoff = FIRST_BACKOFF if accepted else min(2 * state.backoff, MAX_BACKOFF)
            state.trying = False

    def release(self, seq_ids: Iterable[int]) -> None:
        seq_ids = tuple(seq_ids)
        for seq_id in seq_ids:
            self.seqs.pop(seq_id, None)
        if self.model is not None:
            self.model.forget(seq_ids)
