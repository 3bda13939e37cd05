"""What a request must be before it is queued: its id, and its prompt's token ids checked
against the model (vocabulary, max_model_len) and its own sampling settings."""

from __future__ import annotations

from fastgen.config import EngineConfig
from fastgen.engine.prompts import Prompt, token_ids_of
from fastgen.sampling_params import SamplingParams


class EngineOverloaded(RuntimeError):
    """The engine refused a request because max_waiting_requests requests already wait; retry
    later (the server answers HTTP 503 with Retry-After)."""


def check_request_id(request_id: object) -> str:
    """Request ids are non-empty strings (an int 5 and the string "5" must never be two names
    for one request); ValueError for anything else."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id={request_id!r} must be a non-empty string, got {type(request_id).__name__}")
    return request_id


def prompt_token_ids(prompt: Prompt, params: SamplingParams, tokenizer,
                     config: EngineConfig) -> tuple[str | None, list[int]]:
    """The prompt's text (None for token ids) and token ids; ValueError naming what is wrong."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt is a string but the engine was started with skip_tokenizer_init=True")
        text = prompt
        token_ids = tokenizer.encode(prompt) if prompt else []
    else:
        text = None
        token_ids = token_ids_of(prompt)
    if not token_ids:
        raise ValueError(f"prompt={prompt!r} is empty: a request needs at least 1 token")
    vocab = config.model_config.vocab_size
    for t in params.stop_token_ids:
        if t >= vocab:
            raise ValueError(f"stop_token_ids holds {t}, outside the vocabulary [0, {vocab})")
    for i, t in enumerate(token_ids):
        if not 0 <= t < vocab:
            raise ValueError(f"prompt token_ids[{i}]={t!r} is outside the vocabulary [0, {vocab})")
    total = len(token_ids) + params.max_tokens
    if total > config.max_model_len:
        raise ValueError(
            f"prompt length {len(token_ids)} + max_tokens {params.max_tokens} = {total} "
            f"exceeds max_model_len={config.max_model_len}"
        )
    return text, token_ids
