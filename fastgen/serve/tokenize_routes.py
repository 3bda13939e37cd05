"""POST /tokenize and POST /detokenize (vLLM's routes): the server's own tokenizer, so a client
can count a prompt's tokens against max_model_len, or read token ids, without loading the model."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from fastgen.engine.prompts import chat_token_ids, encode_text
from fastgen.serve.errors import RequestError
from fastgen.serve.openai_routes import chat_messages
from fastgen.serve.protocol import DetokenizeRequest, TokenizeRequest
from fastgen.serve.state import ServerState

router = APIRouter()


def _tokenizer(state: ServerState):
    if state.tokenizer is None:
        raise RequestError("this server has no tokenizer", param="tokenizer")
    return state.tokenizer


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    state: ServerState = request.app.state.server
    state.check_model(body.model)
    tokenizer = _tokenizer(state)
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("send exactly one of prompt and messages", param="prompt")
    # In a worker thread: the event loop serves every other stream meanwhile.
    return await asyncio.to_thread(_tokenize, state, tokenizer, body)


def _tokenize(state: ServerState, tokenizer, body: TokenizeRequest) -> dict:
    if body.prompt is not None:
        # Text too long to fit in the model is refused before it is tokenized (seconds of the GIL).
        tokens = encode_text(tokenizer, body.prompt, "prompt", max_tokens=state.max_model_len,
                             add_special_tokens=body.add_special_tokens)
    else:
        messages = chat_messages(body.messages)
        tokens = chat_token_ids(tokenizer, messages, add_generation_prompt=body.add_generation_prompt,
                                max_tokens=state.max_model_len)
    answer = {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        answer["token_strs"] = [tokenizer.decode([t]) for t in tokens]
    return answer


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state: ServerState = request.app.state.server
    state.check_model(body.model)
    for i, token in enumerate(body.tokens):
        if not 0 <= token < state.vocab_size:
            raise RequestError(f"tokens[{i}]={token} is outside the vocabulary [0, {state.vocab_size})",
                               param="tokens")
    return {"prompt": _tokenizer(state).decode(body.tokens)}
