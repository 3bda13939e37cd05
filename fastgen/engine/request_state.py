"""A request's life outside the scheduler: its text, stop strings, timings and stream cursor."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from fastgen.engine.detokenizer import IncrementalDetokenizer
from fastgen.engine.logprob_dicts import TokenTexts, position_logprobs
from fastgen.outputs import CompletionOutput, RequestMetrics, RequestOutput
from fastgen.sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from fastgen.worker.top_logprobs import TopLogprobs


class RequestState:
    """Follows one sequence and turns its progress into `RequestOutput`s.

    Stop strings: the text is searched after every token; on a match the text is cut before the
    stop string and the request finishes with reason "stop". So that a stream never yields text
    that a later token turns into part of a stop string, the last len(longest stop) - 1
    characters are held back until the request finishes.

    final_only: emit one output, when the request finishes (what a batch `generate` needs). Such a
    request without stop strings also skips per-step detokenization: its text is decoded once
    at the end, by the same detokenizer, so it is the same text.

    Logprobs (when the request asks): the worker's numbers become vLLM's dicts as they arrive
    (`add_logprobs`, `add_prompt_logprobs`), decoded tokens from `token_texts`.
    """

    def __init__(self, request_id: str, seq: Sequence, prompt: str | None, tokenizer, arrival_time: float,
                 final_only: bool = False, token_texts: TokenTexts | None = None):
        self.request_id = request_id
        self.seq = seq
        self.prompt = prompt
        self.prompt_token_ids = seq.token_ids[: seq.num_prompt_tokens]  # shared by every output
        self.final_only = final_only
        self.error: str | None = None  # why it finished with reason "error"
        self.grammar = None  # its structured-output grammar, compiled when it was added (fastgen.structured)
        self.prediction_token_ids: list[int] | None = None  # its predicted output (speculative decoding's drafts)
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.stop = seq.params.stop
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        # Reported once, at the end, with no stop string to look for: until it finishes, a new
        # token changes only its metrics (see `note_token`), and its text is decoded at once.
        self.quiet = final_only and not self.stop
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, self.prompt_token_ids, streamed=not self.quiet)
            if tokenizer is not None else None
        )
        self.text = ""
        self.num_tokens_seen = 0
        self.sent_text_len = 0
        self.sent_tokens = 0
        params = seq.params
        self.token_texts = token_texts or TokenTexts(tokenizer)
        self.logprobs = None if params.logprobs is None else []
        self.cumulative_logprob = None if params.logprobs is None else 0.0
        self.prompt_logprobs = None if params.prompt_logprobs is None else [None] * seq.num_prompt_tokens

    def add_logprobs(self, top: "TopLogprobs") -> None:
        """The logprobs of the token just sampled."""
        self.logprobs.append(position_logprobs(top, self.token_texts))
        self.cumulative_logprob += top.logprobs[0]

    def add_prompt_logprobs(self, start: int, tops: list["TopLogprobs"]) -> None:
        """Logprobs of prompt tokens start, start + 1, ... (a recomputed chunk overwrites)."""
        for position, top in enumerate(tops, start):
            self.prompt_logprobs[position] = position_logprobs(top, self.token_texts)

    def on_scheduled(self, now: float) -> None:
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = now
            self.metrics.num_cached_tokens = self.seq.num_cached_tokens

    def note_token(self, now: float) -> None:
        """A quiet request's token that did not finish it: its times only (no text, no output;
        the token count is taken when an output is made, see `make_output`)."""
        m = self.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now

    def on_new_tokens(self, now: float) -> bool:
        """Take the sequence's new tokens into the metrics and the text; True when a stop string
        matched."""
        seq = self.seq
        num_output = len(seq.token_ids) - seq.num_prompt_tokens
        if num_output != self.num_tokens_seen:
            self.num_tokens_seen = num_output
            m = self.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            m.num_output_tokens = num_output
        return self._update_text()

    def _update_text(self) -> bool:
        seq = self.seq
        if self.detokenizer is None or (self.final_only and not self.stop and not seq.is_finished):
            return False
        new_ids = seq.token_ids[seq.num_prompt_tokens + self.detokenizer.num_output_tokens :]
        before = len(self.text)
        if self.stop and len(new_ids) > 1:
            # Several tokens in one step (speculative decoding's accepted drafts): taken one at a
            # time, so the request ends at the token that completes a stop string, as it would
            # have decoding one token a step; the tokens after it are dropped.
            for i, token in enumerate(new_ids):
                searched = len(self.text)
                self.text += self.detokenizer.add([token])
                if self._cut_stop_string(searched, seq.num_output_tokens - (len(new_ids) - i - 1)):
                    if i + 1 < len(new_ids):
                        del seq.token_ids[len(seq.token_ids) - (len(new_ids) - i - 1):]
                        self.metrics.num_output_tokens = self.num_tokens_seen = seq.num_output_tokens
                    return True
            new_ids = []
            before = len(self.text)  # each token's text was looked at, with its own count
        if new_ids:
            self.text += self.detokenizer.add(new_ids)
        if seq.is_finished:
            self.text += self.detokenizer.flush()
        return self._cut_stop_string(before)

    def final_output(self, now: float) -> RequestOutput:
        """The final output of a request finished outside a step (aborted, or failed): its text
        caught up with every token it has."""
        assert self.seq.is_finished
        self._update_text()
        return self.make_output(now)

    def _cut_stop_string(self, searched_up_to: int, num_output: int | None = None) -> bool:
        """Cut the text at the first stop string that ends past `searched_up_to`; True if one
        did. num_output: the output tokens the text holds (default: the sequence's), which
        min_tokens counts: none matches until there are more than min_tokens."""
        if num_output is None:
            num_output = self.seq.num_output_tokens
        if not self.stop or num_output <= self.seq.params.min_tokens:
            return False
        # Each string is looked for where an occurrence would end in the new text: one wholly in
        # text searched before was skipped then on purpose (before min_tokens), and stays skipped.
        hits = [i for i in (self.text.find(s, max(0, searched_up_to - len(s) + 1)) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def make_output(self, now: float) -> RequestOutput | None:
        """The delta since the previous output, or None when there is nothing new to say."""
        seq = self.seq
        finished = seq.is_finished
        if finished and self.metrics.finished_time is None:
            self.metrics.finished_time = now
        if self.final_only and not finished:
            return None
        visible = len(self.text) if finished else max(self.sent_text_len, len(self.text) - self.hold_back)
        token_ids = seq.output_token_ids
        self.metrics.num_output_tokens = len(token_ids)  # current even where `note_token` kept only times
        if not finished and visible == self.sent_text_len and len(token_ids) == self.sent_tokens:
            return None
        new_text = self.text[self.sent_text_len : visible]
        new_ids = token_ids[self.sent_tokens :]
        sent_before = self.sent_tokens
        self.sent_text_len, self.sent_tokens = visible, len(token_ids)
        reason = seq.finish_reason
        output = RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            text=self.text[:visible],
            token_ids=token_ids,  # a fresh list (a slice of the sequence's)
            new_text=new_text,
            new_token_ids=list(new_ids),
            finished=finished,
            finish_reason=reason.value if isinstance(reason, FinishReason) else None,
            metrics=self.metrics,
            error=self.error,
        )
        output.outputs = [self._completion(output, sent_before)]
        output.prompt_logprobs = self.prompt_logprobs
        return output

    def _completion(self, output: RequestOutput, sent_before: int) -> CompletionOutput:
        """This sequence's completion, sharing the output's lists (`sent_before`: tokens sent in
        earlier outputs)."""
        logprobs = None if self.logprobs is None else self.logprobs[: len(output.token_ids)]
        return CompletionOutput(
            index=0, text=output.text, token_ids=output.token_ids, finish_reason=output.finish_reason,
            logprobs=logprobs, cumulative_logprob=self.cumulative_logprob, new_text=output.new_text,
            new_token_ids=output.new_token_ids, new_logprobs=None if logprobs is None else logprobs[sent_before:],
        )


def now() -> float:
    return time.perf_counter()
