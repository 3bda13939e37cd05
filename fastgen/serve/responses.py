"""OpenAI response bodies and stream chunks, built from fastgen's `RequestOutput`s (plain dicts:
the `openai` client and any other reads them)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fastgen.outputs import RequestOutput
from fastgen.serve.openai_logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from fastgen.serve.tool_calls import ToolPlan, read_tool_calls


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def choices_of(output: RequestOutput) -> list:
    """The request's completions (each with text, token_ids, new_text, finish_reason)."""
    return getattr(output, "outputs", None) or [output]


def usage(output: RequestOutput, prompt_only: bool = False) -> dict:
    """OpenAI's usage; with speculative decoding's drafts, also OpenAI's counts of predicted
    tokens kept and rejected (here: every draft, from the prediction or looked up)."""
    prompt = len(output.prompt_token_ids)
    completion = 0 if prompt_only else sum(len(c.token_ids) for c in choices_of(output))
    counts = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    m = output.metrics
    if m is not None and m.num_draft_tokens:
        counts["completion_tokens_details"] = {
            "accepted_prediction_tokens": m.num_accepted_draft_tokens,
            "rejected_prediction_tokens": m.num_draft_tokens - m.num_accepted_draft_tokens}
    return counts


@dataclass(frozen=True)
class Echo:
    """A completion that starts with its prompt (OpenAI's `echo`). text: the prompt as sent (None
    for token ids: decode(ids) then). prompt_only: the request asked for max_tokens 0, so the one
    token the engine generated is not shown. token_text(id): the text of a prompt token that has
    no logprob entry (the first)."""

    text: str | None
    prompt_only: bool
    decode: Callable[[list[int]], str]
    token_text: Callable[[int], str]


class ResponseShape:
    """One response's id, model and creation time, shared by all its chunks. chat_top_logprobs:
    how many alternatives each chat logprobs entry lists (completions list what the engine gave).
    tools: how a chat answer's tool calls are read (its text is held back until it ends, then
    sent as content or as tool calls). echo: the prompt that leads each completion.
    token_bytes(id): a token's bytes for chat logprobs (None: its text's UTF-8)."""

    def __init__(self, kind: str, model: str, chat_top_logprobs: int = 0, tools: ToolPlan | None = None,
                 echo: Echo | None = None, token_bytes: Callable[[int], bytes | None] = lambda token_id: None):
        self.kind = kind  # "text_completion" or "chat.completion"
        self.chat_top_logprobs = chat_top_logprobs
        self.token_bytes = token_bytes
        self.tools = tools if tools is not None and tools.mode != "text" else None
        self.echo = echo
        self._echoed: set[int] = set()  # choices whose stream has sent the prompt
        # Choices whose stream has sent their finish: an n > 1 request's later outputs still list
        # them (with their finish_reason, no delta), and OpenAI sends a choice's finish once.
        self._finished: set[int] = set()
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
            return chat_logprobs(token_ids, positions, self.chat_top_logprobs, self.token_bytes)
        logprobs = completion_logprobs(token_ids, positions, self._text_offsets.get(index, 0))
        if logprobs is not None:
            self._text_offsets[index] = self._text_offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
        return logprobs

    def _echoed_prompt(self, index: int, output: RequestOutput, asked_logprobs: bool) -> tuple[str, dict | None]:
        """Choice `index`'s prompt text and logprobs (once per choice), when the request echoes."""
        if self.echo is None or index in self._echoed:
            return "", None
        self._echoed.add(index)
        token_ids = output.prompt_token_ids
        logprobs = None
        if asked_logprobs:
            logprobs = prompt_logprobs(token_ids, output.prompt_logprobs, self.echo.token_text)
            self._text_offsets[index] = sum(map(len, logprobs["tokens"]))
        text = self.echo.text if self.echo.text is not None else self.echo.decode(token_ids)
        return text, logprobs

    def _completion_choice(self, i: int, output: RequestOutput, text: str, token_ids: list[int], positions,
                           finish_reason: str | None) -> dict:
        asked = positions is not None
        prompt_text, prompt_lps = self._echoed_prompt(i, output, asked)
        if self.echo is not None and self.echo.prompt_only:
            text, token_ids, positions = "", [], (None if positions is None else [])
            finish_reason = "length" if finish_reason is not None else None
        logprobs = self._logprobs(i, token_ids, positions)
        if prompt_lps is not None:
            logprobs = {key: prompt_lps[key] + (logprobs or {}).get(key, []) for key in prompt_lps}
        return {"index": i, "text": prompt_text + text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _chat_message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant's message (content, or tool calls read from it) and the finish reason.
        Only an answer that ended on its own finishes with "tool_calls": one cut by max_tokens
        keeps "length" (OpenAI's rule), an aborted or failed one its reason, even where whole
        calls were read before the cut: the caller must know that more may have followed."""
        if self.tools is None:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = read_tool_calls(self.tools, text, finish_reason)
        if not calls:
            return {"role": "assistant", "content": content}, finish_reason
        return ({"role": "assistant", "content": content, "tool_calls": calls},
                "tool_calls" if finish_reason == "stop" else finish_reason)

    def body(self, final: RequestOutput) -> dict:
        """The non-streaming response."""
        choices = []
        for i, c in enumerate(choices_of(final)):
            if self.kind == "text_completion":
                choices.append(self._completion_choice(i, final, c.text, c.token_ids, getattr(c, "logprobs", None),
                                                       c.finish_reason))
                continue
            logprobs = self._logprobs(i, c.token_ids, getattr(c, "logprobs", None))
            message, finish_reason = self._chat_message(c.text, c.finish_reason)
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish_reason})
        prompt_only = self.echo is not None and self.echo.prompt_only
        return {**self._envelope(self.kind, choices), "usage": usage(final, prompt_only)}

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
            if i in self._finished or (not c.new_text and not c.new_token_ids and c.finish_reason is None):
                continue
            if c.finish_reason is not None:
                self._finished.add(i)
            if self.kind == "text_completion":
                if self.echo is not None and self.echo.prompt_only and c.finish_reason is None:
                    continue  # the prompt alone is sent, with the finish
                choices.append(self._completion_choice(i, output, c.new_text, c.new_token_ids,
                                                       getattr(c, "new_logprobs", None), c.finish_reason))
            elif self.tools is not None:  # held back: the whole answer decides text or calls
                if c.finish_reason is None:
                    continue
                logprobs = self._logprobs(i, c.token_ids, getattr(c, "logprobs", None))
                message, finish_reason = self._chat_message(c.text, c.finish_reason)
                delta = {k: v for k, v in message.items() if k != "role" and v is not None}
                for index, call in enumerate(delta.get("tool_calls", ())):
                    call["index"] = index
                choices.append({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})
            else:
                logprobs = self._logprobs(i, c.new_token_ids, getattr(c, "new_logprobs", None))
                delta = {"content": c.new_text} if c.new_text or c.finish_reason is None else {}
                choices.append({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": c.finish_reason})
        if not choices:
            return None
        object_name = "text_completion" if self.kind == "text_completion" else "chat.completion.chunk"
        return self._envelope(object_name, choices)

    def usage_chunk(self, final: RequestOutput) -> dict:
        object_name = "text_completion" if self.kind == "text_completion" else "chat.completion.chunk"
        return {**self._envelope(object_name, []), "usage": usage(final, self.echo is not None and
                                                                    self.echo.prompt_only)}
