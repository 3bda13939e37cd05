"""The request bodies the server accepts, as pydantic models (OpenAI's names, plus vLLM's
sampling extensions). Types are checked here (a wrong type is a 400 naming the field); ranges
are checked by `SamplingParams`, the engine's one source of sampling rules.

Three kinds of field:
- supported: mapped onto `SamplingParams` by `fastgen.serve.sampling`;
- OpenAI fields fastgen cannot honour (`UNSUPPORTED`): a 400 naming the field, unless the value
  is the one that changes nothing (`best_of: 1`, `function_call: "none"`, ...);
- anything else: outside the schema, kept in `model_extra`, ignored with a logged warning.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI field -> the values that ask for nothing fastgen lacks (None: absent).
UNSUPPORTED: dict[str, tuple] = {
    "functions": (None,),  # the deprecated forms of tools / tool_choice
    "function_call": (None, "none"),
    "suffix": (None,),
    "best_of": (None, 1),
    "audio": (None,),
    "modalities": (None, ["text"]),
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
    # token id (as a string, OpenAI's JSON) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}
    response_format: dict[str, Any] | None = None
    # vLLM's field: {"json" | "json_object" | "regex" | "choice" | "grammar": ...}
    structured_outputs: dict[str, Any] | None = None
    # OpenAI's predicted output: {"type": "content", "content": text or [{"type": "text", "text": ...}]};
    # the drafts of speculative decoding where the engine runs it, else ignored.
    prediction: dict[str, Any] | None = None
    # Refused unless harmless (UNSUPPORTED).
    functions: list[Any] | None = None
    function_call: Any = None
    suffix: str | None = None
    best_of: int | None = None
    audio: Any = None
    modalities: list[str] | None = None
    web_search_options: Any = None


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    # The prompt's text (and with logprobs, its tokens' logprobs) before the completion; with
    # max_tokens 0 the prompt alone (lm-evaluation-harness's loglikelihood request).
    echo: bool | None = None


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
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class GenerateRequest(SamplingFields):
    """POST /generate: a prompt (text or token ids) and sampling fields; answered at once with
    the request's id, its result fetched later from GET /result/{seq_id}."""

    prompt: str | list[int]


ResultStatus = Literal["waiting", "running", "finished", "aborted"]


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's route): a prompt, or a conversation rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
