"""OpenAI response bodies and stream chunks, built from fastgen's `RequestOutput`s (plain dicts:
the `openai` client and any other reads them)."""

from __future__ import annotations

import time
import uuid

from fastgen.outputs import RequestOutput
from fastgen.serve.openai_logprobs import chat_logprobs, completion_logprobs


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def choices_of(output: RequestOutput) -> list:
    """The request's completions (each with text, token_ids, new_text, finish_reason)."""
    return getattr(output, "outputs", None) or [output]


def usage(output: RequestOutput) -> dict:
    prompt = len(output.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in choices_of(output))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class ResponseShape:
    """One response's id, model and creation time, shared by all its chunks. chat_top_logprobs:
    how many alternatives each chat logprobs entry lists (completions list what the engine gave)."""

    def __init__(self, kind: str, model: str, chat_top_logprobs: int = 0):
        self.kind = kind  # "text_completion" or "chat.completion"
        self.chat_top_logprobs = chat_top_logprobs
        self._text_offsets: dict[int, int] = {}  # choice -> its tokens' text so far (completions' text_offset)
        self.id = completion_id("cmpl" if kind == "text_completion" else "chatcmpl")
        self.model = model
        self.created = int(time.time())

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def _logprobs(self, index: int, token_ids: list[int], positions) -> dict | None:
        """The logprobs of choice `index`'s next `token_ids` (None when the request asked for
        none). text_offset counts the characters of the choice's earlier tokens' own texts, as
        in vLLM (the streamed text may hold back a partial character)."""
        if self.kind != "text_completion":
            return chat_logprobs(token_ids, positions, self.chat_top_logprobs)
        logprobs = completion_logprobs(token_ids, positions, self._text_offsets.get(index, 0))
        if logprobs is not None:
            self._text_offsets[index] = self._text_offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
        return logprobs

    def body(self, final: RequestOutput) -> dict:
        """The non-streaming response."""
        choices = []
        for i, c in enumerate(choices_of(final)):
            logprobs = self._logprobs(i, c.token_ids, getattr(c, "logprobs", None))
            if self.kind == "text_completion":
                choices.append({"index": i, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": i, "message": {"role": "assistant", "content": c.text},
                                "logprobs": logprobs, "finish_reason": c.finish_reason})
        return {**self._envelope(self.kind, choices), "usage": usage(final)}

    def first_chunk(self, n: int) -> dict | None:
        """Chat streams open with the assistant's role (OpenAI's first delta)."""
        if self.kind == "text_completion":
            return None
        return self._envelope("chat.completion.chunk",
                              [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None} for i in range(n)])

    def chunk(self, output: RequestOutput) -> dict | None:
        """The delta of one output (None when it adds nothing: no text and no finish)."""
        choices = []
        for i, c in enumerate(choices_of(output)):
            if not c.new_text and not c.new_token_ids and c.finish_reason is None:
                continue
            logprobs = self._logprobs(i, c.new_token_ids, getattr(c, "new_logprobs", None))
            if self.kind == "text_completion":
                choices.append({"index": i, "text": c.new_text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason})
            else:
                delta = {"content": c.new_text} if c.new_text or c.finish_reason is None else {}
                choices.append({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": c.finish_reason})
        if not choices:
            return None
        object_name = "text_completion" if self.kind == "text_completion" else "chat.completion.chunk"
        return self._envelope(object_name, choices)

    def usage_chunk(self, final: RequestOutput) -> dict:
        object_name = "text_completion" if self.kind == "text_completion" else "chat.completion.chunk"
        return {**self._envelope(object_name, []), "usage": usage(final)}
