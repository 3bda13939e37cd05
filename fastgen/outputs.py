"""What the engine hands back: for a request, its text and tokens so far and its timings; for a
step, what it did."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestMetrics:
    """Timings in seconds (time.perf_counter clock) and prefix-cache use of one request.

    time_to_first_token: arrival to first output token. time_per_output_token: mean gap between
    output tokens after the first. e2e_latency: arrival to finish (None until finished).
    num_cached_tokens: prompt tokens served from the prefix cache on first admission.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

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
class RequestOutput:
    """A request's state after a step.

    text / token_ids: everything generated so far (stop string cut from text).
    new_text / new_token_ids: what this output adds to the previous one of the same request
    (the pieces a stream yields). finished: this is the request's final output (every request
    gets exactly one). finish_reason, once finished: "stop" (end-of-sequence, a stop token, or a
    stop string, even one completed by the last allowed token), "length" (max_tokens or
    max_model_len), "abort" (aborted) or "error" (a step failed on this request alone; `error`
    says how).
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
    error: str | None = None


@dataclass(frozen=True)
class StepResult:
    """What one `run_step` did. outputs: every output made since the previous step (this step's,
    and final outputs of requests aborted in between), whichever consumer they are for.
    is_prefill: the kind of step (None when there was nothing to run). num_seqs / num_tokens:
    the batch it computed. started_at: perf_counter time the step began."""

    outputs: list[RequestOutput]
    is_prefill: bool | None
    num_seqs: int
    num_tokens: int
    started_at: float
