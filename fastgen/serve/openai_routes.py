"""POST /v1/completions, POST /v1/chat/completions and GET /v1/models."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from fastgen.engine.async_llm import AsyncRequestStream
from fastgen.engine.prompts import chat_token_ids
from fastgen.serve.errors import RequestError
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
    if body.logprobs is not None:
        raise RequestError(f"logprobs={body.logprobs!r} is not served over HTTP yet", param="logprobs")
    params = sampling_params(body)
    stream = await state.submit(_single_prompt(body.prompt), params)
    return await _respond(state, stream, ResponseShape("text_completion", state.model_name), body,
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
    if body.logprobs or body.top_logprobs is not None:
        raise RequestError("logprobs are not served over HTTP yet", param="logprobs")
    prompt = _chat_prompt(state, body)
    limit = chat_max_tokens(body)
    body.max_tokens = limit if limit is not None else max(1, state.max_model_len - len(prompt))
    params = sampling_params(body)
    stream = await state.submit(prompt, params)
    return await _respond(state, stream, ResponseShape("chat.completion", state.model_name), body,
                          getattr(params, "n", 1))


async def _respond(state: ServerState, stream: AsyncRequestStream, shape: ResponseShape, body, n: int):
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return sse_response(_chunks(state, stream, shape, n, include_usage))
    final = None
    async for output in state.tracked(stream):
        final = output
    if final is None or final.finish_reason == "error":
        detail = final.error if final is not None else "the engine stopped"
        raise RequestError(f"generation failed: {detail}", status=500, kind="internal_error")
    return shape.body(final)


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
