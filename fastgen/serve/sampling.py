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
from fastgen.structured_outputs_params import StructuredOutputsParams

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


# What one request may ask for at the door (the engine's own limits — max_model_len, max_logprobs,
# logit_bias entries — apply after these): OpenAI's n and stop limits, a little wider.
LIST_LIMITS = {"n": 128, "stop": 16, "stop_token_ids": 1024}
STOP_STRING_MAX_CHARS = 1024


def check_fields(request: SamplingFields, endpoint: str) -> None:
    """400 for an OpenAI field fastgen cannot honour or a list over this server's limits; a
    logged warning for fields outside the schema (ignored, as vLLM does)."""
    for name, harmless in UNSUPPORTED.items():
        value = getattr(request, name, None)
        if value not in harmless:
            raise RequestError(f"{name}={value!r} is not supported by fastgen", param=name)
    if getattr(request, "stream_options", None) is not None and not getattr(request, "stream", False):
        raise RequestError("stream_options is only allowed with stream=true (OpenAI's rule)", param="stream_options")
    if request.n is not None and request.n > LIST_LIMITS["n"]:
        raise RequestError(f"n={request.n} must be <= {LIST_LIMITS['n']} on this server", param="n")
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
    for name, values in (("stop", stops), ("stop_token_ids", request.stop_token_ids or [])):
        if len(values) > LIST_LIMITS[name]:
            raise RequestError(f"{name} holds {len(values)} entries, more than this server's {LIST_LIMITS[name]}",
                               param=name)
    for text in stops:
        if len(text) > STOP_STRING_MAX_CHARS:
            raise RequestError(f"stop holds a string of {len(text)} characters, more than {STOP_STRING_MAX_CHARS}",
                               param="stop")
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
    if request.logit_bias:
        kwargs["logit_bias"] = _logit_bias(request.logit_bias)
    structured = structured_outputs(request)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    if request.prediction is not None:
        kwargs["prediction"] = predicted_text(request.prediction)
    for name, value in extra.items():
        if value is None:
            continue
        if name not in _PARAMS:
            raise RequestError(f"{name}={value!r} is not supported by this fastgen build", param=name)
        kwargs[name] = value
    return SamplingParams(**kwargs)


# Completions' max_tokens when the request has none: OpenAI's default, cut to what the context
# leaves (as vLLM does), so that a long prompt alone is not refused for tokens nobody asked for.
COMPLETION_MAX_TOKENS_DEFAULT = 16


def chat_max_tokens(request: ChatCompletionRequest, prompt_len: int, max_model_len: int) -> int:
    """Chat's token limit: max_completion_tokens (OpenAI's newer name) wins over max_tokens; with
    neither, what max_model_len leaves. A 400 naming the field the request sent when it is below
    1 or does not fit beside the prompt."""
    field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    limit = getattr(request, field)
    if limit is None:
        return max(1, max_model_len - prompt_len)
    if limit < 1:
        raise RequestError(f"{field}={limit} must be >= 1", param=field)
    if prompt_len + limit > max_model_len:
        raise RequestError(f"prompt length {prompt_len} + {field} {limit} = {prompt_len + limit} exceeds "
                           f"max_model_len={max_model_len}", param=field)
    return limit


def completion_max_tokens(prompt_len: int, max_model_len: int) -> int:
    """Completions' max_tokens for a request without one; a 400 naming the prompt when it leaves
    no room for a token."""
    if prompt_len >= max_model_len:
        raise RequestError(f"prompt length {prompt_len} leaves no room for a token within "
                           f"max_model_len={max_model_len}", param="prompt")
    return min(COMPLETION_MAX_TOKENS_DEFAULT, max_model_len - prompt_len)


def predicted_text(prediction: dict) -> str:
    """OpenAI's `prediction` as text: {"type": "content", "content": a string, or a list of
    {"type": "text", "text": ...} parts (joined)}. A 400 naming the field otherwise."""
    content = prediction.get("content")
    if prediction.get("type") != "content":
        raise RequestError(f"prediction.type={prediction.get('type')!r} must be 'content'", param="prediction")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    raise RequestError("prediction.content must be a string or a list of {'type': 'text', 'text': ...} parts",
                       param="prediction")


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's keys are token ids written as strings."""
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise RequestError(f"logit_bias has key {key!r}; keys must be token ids", param="logit_bias") from None
        out[token] = value
    return out


def structured_outputs(request: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint: OpenAI's `response_format` or vLLM's `structured_outputs`
    (not both); None for plain text. ValueError (a 400) naming what is wrong."""
    fmt, fields = request.response_format, request.structured_outputs
    if fmt is not None and fields is not None and fmt.get("type") != "text":
        raise RequestError("response_format and structured_outputs both constrain the output; send one",
                           param="structured_outputs")
    if fields is not None:
        try:
            return StructuredOutputsParams.from_dict(fields)
        except ValueError as exc:
            raise RequestError(str(exc), param="structured_outputs") from None
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise RequestError(f"response_format.type={kind!r} must be 'text', 'json_object' or 'json_schema'",
                           param="response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise RequestError("response_format.json_schema must be an object with a 'schema' object (and a 'name')",
                           param="response_format")
    return StructuredOutputsParams(json=spec["schema"])
