"""The request bodies the server accepts, as pydantic models (OpenAI's names, plus vLLM's
sampling extensions). Types are checked here (a wrong type is a 400 naming the field); ranges
are checked by `SamplingParams`, the engine's one source of sampling rules.

Three kinds of field:
- supported: mapped onto `SamplingParams` by `fastgen.serve.sampling`;
- OpenAI fields fastgen cannot honour (`UNSUPPORTED`): a 400 naming the field, unless the value
  is the one that changes nothing (`echo: false`, `best_of: 1`, ...);
- anything else: outside the schema, kept in `model_extra`, ignored with a logged warning.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI field -> the values that ask for nothing fastgen lacks (None: absent).
UNSUPPORTED: dict[str, tuple] = {
    "logit_bias": (None,),
    "tools": (None,),
    "tool_choice": (None, "none"),
    "functions": (None,),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}),
    "suffix": (None,),
    "echo": (None, False),
    "best_of": (None, 1),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Sampling fields shared by every generation endpoint."""

    model_config = ConfigDict(extra="allow")

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extensions, under vLLM's names.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    # Accepted and ignored, as OpenAI does with an end-user id.
    user: str | None = None
    # Refused unless harmless (UNSUPPORTED).
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    suffix: str | None = None
    echo: bool | None = None
    best_of: int | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class GenerateRequest(SamplingFields):
    """POST /generate: a prompt (text or token ids) and sampling fields; answered at once with
    the request's id, its result fetched later from GET /result/{seq_id}."""

    prompt: str | list[int]


ResultStatus = Literal["waiting", "running", "finished", "aborted"]
