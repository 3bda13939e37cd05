"""Logprobs in OpenAI's two shapes, built from fastgen's per-token dicts
({token_id: Logprob(logprob, rank, decoded_token)}, the sampled token and the top k).

    completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: logprob}, ...],
                  "text_offset": [...]}      one entry per generated token; top_logprobs holds the
                                              sampled token and the top k (OpenAI's "k + 1")
    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
                  "bytes"}, ...]}]}          top_logprobs: the k most likely, best first

-inf (a token the model rules out) is sent as -9999.0, as OpenAI and vLLM do: JSON has no -inf.
"""

from __future__ import annotations

from collections.abc import Callable

from fastgen.outputs import Logprob, PositionLogprobs
from fastgen.serve.errors import RequestError

# OpenAI's own cap on chat's top_logprobs.
CHAT_TOP_LOGPROBS_MAX = 20
_FLOOR = -9999.0


def checked_count(name: str, value: int | None, limit: int) -> int | None:
    """`value` (how many top logprobs a request asks for) if in [0, limit]; else a 400 naming
    the field, the value and the limit."""
    if value is not None and not 0 <= value <= limit:
        raise RequestError(f"{name}={value} must be in [0, {limit}] (this server's max_logprobs)", param=name)
    return value


def _text(token_id: int, logprob: Logprob) -> str:
    # Without a tokenizer, vLLM's spelling of a bare token id.
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def _value(logprob: Logprob) -> float:
    return max(logprob.logprob, _FLOOR)


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs] | None,
                        text_offset: int) -> dict | None:
    """The completions shape for `token_ids` (their dicts in `positions`); text_offset: the
    length of the completion's text before the first of them."""
    if positions is None:
        return None
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, position in zip(token_ids, positions):
        text = _text(token_id, position[token_id])
        tokens.append(text)
        token_logprobs.append(_value(position[token_id]))
        top_logprobs.append(_by_text(token_id, position))
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def prompt_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None] | None,
                    token_text) -> dict | None:
    """The completions shape for an echoed prompt: its first token (and any position without
    logprobs) has token_logprobs and top_logprobs None, as in OpenAI's echo. token_text(id): a
    token's text where no logprob entry names it."""
    if positions is None:
        return None
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for token_id, position in zip(token_ids, positions):
        text = _text(token_id, position[token_id]) if position else token_text(token_id)
        tokens.append(text)
        token_logprobs.append(_value(position[token_id]) if position else None)
        top_logprobs.append(_by_text(token_id, position) if position else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _by_text(token_id: int, position: PositionLogprobs) -> dict[str, float]:
    """{text: logprob} of the sampled token and the top k. Distinct tokens may share a text
    (byte pieces all read "\ufffd"): the sampled token's own value, else the likeliest, wins."""
    ranked = sorted(position.items(), key=lambda item: (item[0] != token_id, -item[1].logprob))
    top: dict[str, float] = {}
    for t, lp in ranked:
        top.setdefault(_text(t, lp), _value(lp))
    return top


def _chat_entry(token_id: int, logprob: Logprob, token_bytes: Callable[[int], bytes | None]) -> dict:
    text = _text(token_id, logprob)
    raw = token_bytes(token_id)
    return {"token": text, "logprob": _value(logprob),
            "bytes": list(raw if raw is not None else text.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs] | None, top: int,
                  token_bytes: Callable[[int], bytes | None] = lambda token_id: None) -> dict | None:
    """The chat shape for `token_ids` (their dicts in `positions`), `top` alternatives each.
    token_bytes(id): the bytes a token stands for (`token_bytes_reader`), so that a character
    split over tokens joins back from their `bytes`; None: its text's UTF-8."""
    if positions is None:
        return None
    content = []
    for token_id, position in zip(token_ids, positions):
        best = sorted(position.items(), key=lambda item: -item[1].logprob)[:top]
        content.append({**_chat_entry(token_id, position[token_id], token_bytes),
                        "top_logprobs": [_chat_entry(t, lp, token_bytes) for t, lp in best]})
    return {"content": content}
