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
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)

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
