"""Per-request sampling settings, validated where the user hands them in."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How one request is decoded.

    temperature: 0 means greedy; otherwise logits are divided by it before sampling.
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
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = list(self.stop_token_ids)
        self.stop = list(self.stop)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {token_id!r}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop must hold non-empty strings, got {text!r}")
