"""The worker's logprobs as vLLM returns them: a dict per position, token id -> Logprob."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastgen.outputs import Logprob, PositionLogprobs

if TYPE_CHECKING:
    from fastgen.worker.top_logprobs import TopLogprobs


class TokenTexts:
    """Each token's text on its own (vLLM's `decoded_token`: special tokens kept), decoded once
    per token id and engine; None without a tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def position_logprobs(top: "TopLogprobs", token_texts: TokenTexts) -> PositionLogprobs:
    """The chosen token with its rank, then the top k ranked 1..k; a chosen token among the top
    k appears once, as in vLLM."""
    ranks = [top.rank, *range(1, len(top.token_ids))]
    return {token: Logprob(logprob, rank, token_texts(token))
            for token, logprob, rank in zip(top.token_ids, top.logprobs, ranks)}
