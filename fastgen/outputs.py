"""What the engine hands back: for a request, its text and tokens so far and its timings; for a
step, what it did."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Timings in seconds (time.perf_counter clock) and prefix-cache use of one request.

    time_to_first_token: arrival to first output token. time_per_output_token: mean gap between
    output tokens after the first. e2e_latency: arrival to finish (None until finished).
    num_cached_tokens: prompt tokens served from the prefix cache on first admission.
    Speculative decoding: num_draft_tokens proposed and verified, num_accepted_draft_tokens of them
    kept, accepted_per_position[i] the verifications that kept draft position i.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class Logprob:
    """A token's log-probability under the model's raw distribution (vLLM's shape): `rank` is its
    1-based place among the vocabulary (ties share the lowest place), `decoded_token` its text
    on its own (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: the chosen token (sampled, or the prompt's own) and the top-k, by token id.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of a request's `n` completions (vLLM's shape).

    index: its place in RequestOutput.outputs. text / token_ids: everything it generated so far
    (stop string cut from text); new_text / new_token_ids: what this output adds to the previous
    one. logprobs: one dict per token in token_ids when the request asked for them (else None),
    new_logprobs the ones for new_token_ids; cumulative_logprob: the sum of the chosen tokens'.
    finish_reason: "stop", "length" or "abort" once this completion has finished.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step.

    text / token_ids: everything generated so far (stop string cut from text).
    new_text / new_token_ids: what this output adds to the previous one of the same request
    (the pieces a stream yields). finished: this is the request's final output (every request
    gets exactly one). finish_reason, once finished: "stop" (end-of-sequence, a stop token, or a
    stop string, even one completed by the last allowed token), "length" (max_tokens or
    max_model_len), "abort" (aborted) or "error" (a step failed on this request alone; `error`
    says how).

    outputs: the request's `n` completions, each with its own text, tokens, deltas, logprobs
    and finish_reason; text, token_ids, new_text, new_token_ids and finish_reason above are
    outputs[0]'s, and `finished` means every completion has. prompt_logprobs: one entry per
    prompt token when asked for (the first None), else None. With n > 1, metrics cover all
    completions (num_output_tokens is their sum).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: str | None = None


@dataclass(frozen=True)
class StepResult:
    """What one `run_step` did. outputs: every output made since the previous step (this step's,
    and final outputs of requests aborted in between), whichever consumer they are for.
    is_prefill: the kind of step (None when there was nothing to run): True when it computed
    prompt tokens, of which it may also have decoded `num_decodes` sequences (a mixed step).
    num_seqs / num_tokens: the batch it computed. num_sampled: output tokens it produced.
    started_at: perf_counter time the step began. With overlap scheduling the kind and batch
    describe the step launched by this call, and num_sampled and the outputs the tokens read in
    it, those of the step launched by the call before (is_prefill None: nothing was launched,
    only that step read)."""

    outputs: list[RequestOutput]
    is_prefill: bool | None
    num_seqs: int
    num_tokens: int
    num_sampled: int
    started_at: float
    num_decodes: int = 0
    num_draft_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_tokens - self.num_decodes - self.num_draft_tokens
