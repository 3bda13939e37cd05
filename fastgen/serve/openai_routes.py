"""POST /v1/completions, POST /v1/chat/completions and GET /v1/models."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response

from fastgen.engine.async_llm import AsyncRequestStream
from fastgen.engine.prompts import chat_token_ids
from fastgen.serve.disconnect import DISCONNECTED, unless_disconnected
from fastgen.serve.errors import RequestError
from fastgen.serve.openai_logprobs import CHAT_TOP_LOGPROBS_MAX, checked_count
from fastgen.serve.protocol import ChatCompletionRequest, CompletionRequest
from fastgen.serve.responses import ResponseShape
from fastgen.serve.sampling import chat_max_tokens, check_fields, sampling_params
from fastgen.serve.sse import sse_response
from fastgen.serve.state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/v1/models")
async def models(request: Request) -> dict:
    state = _state(request)
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(time.time()),
                                        "owned_by": "fastgen", "max_model_len": state.max_model_len,
                                        "vocab_size": state.vocab_size}]}


def _single_prompt(prompt) -> str | list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise RequestError(f"prompt holds {len(prompt)} prompts; fastgen serves one prompt per request",
                               param="prompt")
        return prompt[0]
    return prompt


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = _state(request)
    check_fields(body, "/v1/completions")
    state.check_model(body.model)
    params = sampling_params(body, logprobs=checked_count("logprobs", body.logprobs, state.max_logprobs))
    stream = await state.submit(_single_prompt(body.prompt), params)
    return await _respond(state, request, stream, ResponseShape("text_completion", state.model_name), body,
                          getattr(params, "n", 1))


def _chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    messages = []
    for i, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):  # content parts: only text is served
            for part in content:
                if part.get("type") != "text":
                    raise RequestError(f"messages[{i}].content holds a {part.get('type')!r} part; "
                                       "fastgen serves text only", param=f"messages.{i}.content")
            content = "".join(part.get("text", "") for part in content)
        messages.append({**(message.model_extra or {}), "role": message.role, "content": content or ""})
    if state.tokenizer is None:
        raise RequestError("this server has no tokenizer for chat", param="messages")
    return chat_token_ids(state.tokenizer, messages)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = _state(request)
    check_fields(body, "/v1/chat/completions")
    state.check_model(body.model)
    top_logprobs = _chat_top_logprobs(state, body)
    prompt = _chat_prompt(state, body)
    limit = chat_max_tokens(body)
    body.max_tokens = limit if limit is not None else max(1, state.max_model_len - len(prompt))
    params = sampling_params(body, logprobs=top_logprobs)
    stream = await state.submit(prompt, params)
    return await _respond(state, request, stream,
                          ResponseShape("chat.completion", state.model_name, chat_top_logprobs=top_logprobs or 0),
                          body, getattr(params, "n", 1))


def _chat_top_logprobs(state: ServerState, body: ChatCompletionRequest) -> int | None:
    """How many alternatives chat's logprobs list per token (None: no logprobs asked for)."""
    if not body.logprobs:
        if body.top_logprobs is not None:
            raise RequestError(f"top_logprobs={body.top_logprobs} needs logprobs=true", param="top_logprobs")
        return None
    limit = min(CHAT_TOP_LOGPROBS_MAX, state.max_logprobs)
    return checked_count("top_logprobs", body.top_logprobs if body.top_logprobs is not None else 0, limit)


async def _respond(state: ServerState, request: Request, stream: AsyncRequestStream, shape: ResponseShape, body,
                   n: int):
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return sse_response(_chunks(state, stream, shape, n, include_usage))
    final = await unless_disconnected(request, _final(state, stream))
    if final is DISCONNECTED:  # its request is aborted; nobody is left to read the answer
        return Response(status_code=499)
    if final is None or final.finish_reason == "error":
        detail = final.error if final is not None else "the engine stopped"
        raise RequestError(f"generation failed: {detail}", status=500, kind="internal_error")
    return shape.body(final)


async def _final(state: ServerState, stream: AsyncRequestStream):
    """The stream's last output (None if it ended without one)."""
    final = None
    async for output in state.tracked(stream):
        final = output
    return final


async def _chunks(state: ServerState, stream: AsyncRequestStream, shape: ResponseShape, n: int,
                  include_usage: bool) -> AsyncIterator[dict]:
    first = shape.first_chunk(n)
    if first is not None:
        yield first
    final = None
    async for output in state.tracked(stream):
        chunk = shape.chunk(output)
        if chunk is not None:
            yield chunk
        if output.finished:
            final = output
    if include_usage and final is not None:
        yield shape.usage_chunk(final)
