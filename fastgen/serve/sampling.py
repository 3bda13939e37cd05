"""OpenAI request fields -> `SamplingParams`.

Every field the request model names and `SamplingParams` supports maps by name (OpenAI's names
are vLLM's); a supported field that this build's `SamplingParams` lacks is refused like any other
field fastgen cannot honour. Range checks are `SamplingParams`' own: its ValueError names the
field, the value and the limit, and becomes a 400.
"""

from __future__ import annotations

import dataclasses
import logging

from fastgen.sampling_params import SamplingParams
from fastgen.serve.errors import RequestError
from fastgen.serve.protocol import UNSUPPORTED, ChatCompletionRequest, SamplingFields

logger = logging.getLogger(__name__)

_PARAMS = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
# Request fields that are sampling settings under the same name.
_SAMPLING = ("max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
             "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids")
# OpenAI's default temperature is 1 and its default max_tokens for completions is 16, as
# SamplingParams' own defaults. Values that ask for nothing, accepted even by a build whose
# SamplingParams lacks the field:
_NEUTRAL = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
            "min_tokens": 0, "min_p": 0.0}


def check_fields(request: SamplingFields, endpoint: str) -> None:
    """400 for an OpenAI field fastgen cannot honour; a logged warning for fields outside the
    schema (ignored, as vLLM does)."""
    for name, harmless in UNSUPPORTED.items():
        value = getattr(request, name, None)
        if value not in harmless:
            raise RequestError(f"{name}={value!r} is not supported by fastgen", param=name)
    if request.model_extra:
        logger.warning("%s: ignoring unknown field(s) %s", endpoint, sorted(request.model_extra))


def sampling_params(request: SamplingFields, max_tokens: int | None = None, **extra) -> SamplingParams:
    """The request's SamplingParams. max_tokens: used when the request sets none. extra: further
    SamplingParams fields the endpoint computed (logprobs, say). ValueError for a bad value."""
    kwargs = {}
    for name in _SAMPLING:
        value = getattr(request, name)
        if value is None or (name not in _PARAMS and _NEUTRAL.get(name, object()) == value):
            continue
        if name not in _PARAMS:
            raise RequestError(f"{name}={value!r} is not supported by this fastgen build", param=name)
        kwargs[name] = value
    if "max_tokens" not in kwargs and max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    for name, value in extra.items():
        if value is None:
            continue
        if name not in _PARAMS:
            raise RequestError(f"{name}={value!r} is not supported by this fastgen build", param=name)
        kwargs[name] = value
    return SamplingParams(**kwargs)


def chat_max_tokens(request: ChatCompletionRequest) -> int | None:
    """Chat's token limit: max_completion_tokens (OpenAI's newer name) wins over max_tokens."""
    return request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
