"""Per-request sampling settings, validated where the user hands them in."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Temperatures below this are greedy: dividing logits by a smaller one overflows float32 (and
# argmax is what such a temperature means anyway).
MIN_SAMPLING_TEMPERATURE = 1e-5
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds in [0, 2**64)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How one request is decoded.

    temperature: 0 (or below 1e-5) means greedy; otherwise logits are divided by it before sampling.
    top_k: keep the k most likely tokens; -1 keeps all.
    top_p: keep the smallest set of tokens whose probability mass reaches top_p (1.0 keeps all).
    max_tokens: the most tokens generated for this request.
    ignore_eos: keep generating past the model's end-of-sequence token.
    seed: makes this request's sampling reproducible, whatever else is in the batch.
    stop_token_ids: extra token ids that end the request (the token is kept in the output).
    stop: strings that end the request; the matched string is cut from the text.

    vLLM's further fields, with vLLM's meanings:
    n: completions of the prompt, sampled independently (one prefill; see RequestOutput.outputs).
        With a seed, completion i samples with seed + i.
    logprobs: per generated token, return the log-probabilities of the sampled token and of the
        `logprobs` most likely tokens (None: none). From the model's raw log-softmax, before
        temperature, penalties and filtering. At most the engine's max_logprobs.
    prompt_logprobs: the same for every prompt token (the first has none). Such a request
        computes its whole prompt (it does not read the prefix cache).
    presence_penalty: subtracted from the logit of every token already generated, in [-2, 2].
    frequency_penalty: subtracted once per time a token was generated, in [-2, 2].
    repetition_penalty: divides the positive logits (multiplies the negative ones) of every token
        in the prompt or generated so far, in (0, 2]; 1 is off (transformers' and vLLM's rule).
    min_tokens: generate at least this many tokens: until then end-of-sequence and stop_token_ids
        cannot be sampled and stop strings are not matched. At most max_tokens.
    min_p: drop tokens whose probability is below min_p times the most likely one's (after
        temperature), in [0, 1]; 0 is off.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def validate(self) -> None:
        """Check every field (and normalise the two lists); also called again when a request is
        added, so fields changed after construction are checked too."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
                raise ValueError(f"{name} must be a list, got {value!r}")
            setattr(self, name, list(value))
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < SEED_LIMIT
        ):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {token_id!r}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop must hold non-empty strings, got {text!r}")
        self._validate_vllm_fields()

    # ---- vLLM's further fields ---------------------------------------------------------------
    @property
    def has_penalties(self) -> bool:
        """Whether any of the three penalties is on (the sampler then keeps this request's token counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def _validate_vllm_fields(self) -> None:
        _check_int("n", self.n, 1)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0)
        _check_real("presence_penalty", self.presence_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_real("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_real("repetition_penalty", self.repetition_penalty, 0.0, 2.0, "in (0, 2]", low_open=True)
        _check_real("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")

    def check_logprobs_limit(self, limit: int) -> None:
        """ValueError unless logprobs and prompt_logprobs are at most `limit` (the engine's)."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > limit:
                raise ValueError(f"{name} must be <= {limit} (the engine's max_logprobs, capped at the "
                                 f"vocabulary size), got {value}")


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_real(name: str, value, low: float, high: float, limit: str, low_open: bool = False) -> None:
    if not _is_real(value) or not (low < value if low_open else low <= value) or not value <= high:
        raise ValueError(f"{name} must be {limit}, got {value!r}")
