"""POST /v1/completions, POST /v1/chat/completions and GET /v1/models."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response

from fastgen.engine.async_llm import TOKENIZE_INLINE_MAX_CHARS, AsyncRequestStream
from fastgen.engine.chat_template import message_text
from fastgen.engine.prompts import TokenizedPrompt, chat_token_ids, tokenized_prompt
from fastgen.errors import EngineDeadError
from fastgen.serve.disconnect import DISCONNECTED, unless_disconnected
from fastgen.serve.errors import RequestError
from fastgen.serve.openai_logprobs import CHAT_TOP_LOGPROBS_MAX, checked_count
from fastgen.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from fastgen.serve.responses import Echo, ResponseShape
from fastgen.serve.sampling import chat_max_tokens, check_fields, completion_max_tokens, sampling_params
from fastgen.serve.sse import sse_response
from fastgen.serve.state import ServerState
from fastgen.serve.tool_calls import ToolPlan, plan_tools, template_renders_tools, with_tools_in_system

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
    logprobs = checked_count("logprobs", body.logprobs, state.max_logprobs)
    prompt = await _tokenized(state, _single_prompt(body.prompt))
    prompt_only = bool(body.echo) and body.max_tokens == 0
    if prompt_only:  # the engine generates at least one token; it is not shown
        body.max_tokens = 1
    elif body.max_tokens is None:
        body.max_tokens = completion_max_tokens(_prompt_length(prompt), state.max_model_len)
    params = sampling_params(body, logprobs=logprobs, prompt_logprobs=logprobs if body.echo else None)
    stream = await _submit(state, prompt, params, body)
    echo = _echo(state, prompt, prompt_only) if body.echo else None
    return await _respond(state, request, stream, ResponseShape("text_completion", state.model_name, echo=echo),
                          body, getattr(params, "n", 1))


async def _tokenized(state: ServerState, prompt):
    """A text prompt as a TokenizedPrompt, encoded once (its length sets max_tokens here, and the
    engine takes the ids as they are); a long one in a worker thread, so that the event loop
    serves every other stream meanwhile. A prompt refused here counts as the engine's refusals do."""
    if not isinstance(prompt, str) or state.tokenizer is None:
        return prompt
    try:
        if len(prompt) <= TOKENIZE_INLINE_MAX_CHARS:
            return tokenized_prompt(state.tokenizer, prompt, state.max_model_len)
        return await asyncio.to_thread(tokenized_prompt, state.tokenizer, prompt, state.max_model_len)
    except ValueError:
        state.metrics.rejected.labels("400").inc()
        raise


def _prompt_length(prompt) -> int:
    """The prompt's token count; a prompt the engine will refuse counts 0 here, and the engine
    then says why."""
    if isinstance(prompt, TokenizedPrompt):
        return len(prompt.token_ids)
    return len(prompt) if isinstance(prompt, list) else 0


def _echo(state: ServerState, prompt, prompt_only: bool) -> Echo:
    """The prompt to echo: its text as sent (token ids: decoded), its ids read from the output."""
    tokenizer = state.tokenizer

    def decode(token_ids: list[int]) -> str:
        return tokenizer.decode(token_ids) if tokenizer is not None else ""

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"

    text = prompt.text if isinstance(prompt, TokenizedPrompt) else prompt
    return Echo(text if isinstance(text, str) else None, prompt_only, decode, token_text)


async def _submit(state: ServerState, prompt, params, body: SamplingFields, constraint_field: str | None = None):
    """Queue the request; a constraint that cannot be compiled is a 400 naming the request's own
    field (response_format, tools) rather than the engine's structured_outputs."""
    try:
        # A response sent whole needs the request's final output only: the engine then makes no
        # output a step for it, and none crosses to this event loop before the end.
        return await state.submit(prompt, params, final_only=not body.stream)
    except RequestError:
        raise
    except ValueError as exc:
        uses_format = (body.response_format or {}).get("type", "text") != "text"
        field = constraint_field or ("response_format" if uses_format else None)
        if field is None or not str(exc).startswith("structured_outputs"):
            raise
        raise RequestError(f"{field}: {exc}", param=field) from None


def chat_messages(body_messages) -> list[dict]:
    """The request's messages as the chat template reads them: text parts joined (a part of any
    other type is a 400), fields beyond role and content passed on (tool_calls, tool_call_id)."""
    messages = []
    for i, message in enumerate(body_messages):
        try:
            content = message_text(message.content, f"messages[{i}].content")
        except ValueError as exc:
            raise RequestError(str(exc), param=f"messages.{i}.content") from None
        messages.append({**(message.model_extra or {}), "role": message.role, "content": content or ""})
    return messages


def _chat_prompt(state: ServerState, body: ChatCompletionRequest, tools: ToolPlan) -> TokenizedPrompt:
    """The conversation rendered by the model's template and tokenized (ints: the engine takes
    them without checking each again)."""
    messages = chat_messages(body.messages)
    if state.tokenizer is None:
        raise RequestError("this server has no tokenizer for chat", param="messages")
    limit = state.max_model_len  # a conversation too long to fit is refused before it is tokenized
    if not tools.shown:
        ids = chat_token_ids(state.tokenizer, messages, max_tokens=limit)
    elif template_renders_tools(state.tokenizer):
        ids = chat_token_ids(state.tokenizer, messages, tools=[t.as_openai() for t in tools.shown], max_tokens=limit)
    else:
        ids = chat_token_ids(state.tokenizer, with_tools_in_system(messages, tools.shown), max_tokens=limit)
    return TokenizedPrompt(None, ids)


def _conversation_size(body: ChatCompletionRequest) -> int:
    """The characters of a conversation's text contents (parts counted too; what rendering and
    tokenizing it costs, near enough)."""
    size = 0
    for message in body.messages:
        content = message.content
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            size += sum(len(str(part)) for part in content)
    return size


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = _state(request)
    check_fields(body, "/v1/chat/completions")
    state.check_model(body.model)
    top_logprobs = _chat_top_logprobs(state, body)
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    if tools.constraint is not None and (body.structured_outputs is not None or
                                         (body.response_format or {}).get("type", "text") != "text"):
        raise RequestError(f"tool_choice={body.tool_choice!r} constrains the output, and so does "
                           "response_format / structured_outputs; send one", param="tool_choice")
    # A long conversation is rendered and tokenized in a worker thread: the event loop serves
    # every other stream meanwhile.
    if _conversation_size(body) <= TOKENIZE_INLINE_MAX_CHARS and not tools.shown:
        prompt = _chat_prompt(state, body, tools)
    else:
        prompt = await asyncio.to_thread(_chat_prompt, state, body, tools)
    body.max_tokens = chat_max_tokens(body, len(prompt.token_ids), state.max_model_len)
    params = sampling_params(body, logprobs=top_logprobs, structured_outputs=tools.constraint)
    stream = await _submit(state, prompt, params, body, "tools" if tools.constraint is not None else None)
    shape = ResponseShape("chat.completion", state.model_name, chat_top_logprobs=top_logprobs or 0, tools=tools,
                          token_bytes=state.token_bytes)
    return await _respond(state, request, stream, shape, body, getattr(params, "n", 1))


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
        return sse_response(_chunks(state, stream, shape, n, include_usage), state.stream_idle_timeout_s)
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
    async with contextlib.aclosing(state.tracked(stream)) as outputs:  # closed with this generator
        try:
            async for output in outputs:
                chunk = shape.chunk(output)
                if chunk is not None:
                    yield chunk
                if output.finished:
                    final = output
        except EngineDeadError as exc:  # the stream's last event says why it ends here
            yield {"error": {"message": f"the engine is down: {exc}", "type": "service_unavailable", "param": None,
                             "code": 503}}
            return
    if include_usage and final is not None:
        yield shape.usage_chunk(final)
