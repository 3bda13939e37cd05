"""One request against an OpenAI-compatible /v1/completions endpoint, timed from the client:
streamed (`stream_completion`), when it was sent, when each chunk with generated tokens arrived,
and how many tokens the server says it generated (stream_options.include_usage); plain
(`plain_completion`), when it was sent and when the whole answer arrived, with its usage.

Prompts are token ids (OpenAI's completions API takes them, and so do vLLM and SGLang), so the
prompt length is exact whatever the server's tokenizer. `ignore_eos` (vLLM's extension, which
fastgen shares) makes every request generate exactly max_tokens tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestTiming:
    """Seconds on the client's perf_counter clock. chunk_times: arrival of each chunk that
    carried generated text (a plain request has none: its first token is not seen apart, so
    it has no TTFT, TPOT or inter-token gaps, only its end-to-end latency); output_tokens: the
    server's usage count (else the chunk count)."""

    prompt_len: int
    sent_at: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    done_at: float | None = None
    output_tokens: int = 0
    error: str | None = None
    streamed: bool = True

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_at is not None and (bool(self.chunk_times) or not self.streamed)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.ok and self.streamed else None

    @property
    def e2e(self) -> float | None:
        return self.done_at - self.sent_at if self.ok else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for a single token)."""
        if not self.ok or not self.streamed or self.output_tokens < 2:
            return None
        return (self.done_at - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive chunks (inter-token latency; a chunk may hold several
        tokens when the server batches them)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])] if self.ok else []


async def stream_completion(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                            max_tokens: int, temperature: float) -> RequestTiming:
    """Send one streamed completion and time it; errors are recorded, never raised."""
    timing = RequestTiming(prompt_len=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks, done = 0, False
    timing.sent_at = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if event.get("error"):  # the server failed the request mid-stream
                    timing.error = f"error event: {json.dumps(event['error'])[:200]}"
                    return timing
                if event.get("choices"):
                    timing.chunk_times.append(time.perf_counter())
                    chunks += 1
                    timing.error = _unfinished(event["choices"][0].get("finish_reason"))
                    if timing.error is not None:
                        return timing
                if event.get("usage"):
                    timing.output_tokens = event["usage"]["completion_tokens"]
        if not done:
            timing.error = "the stream ended without [DONE]"
            return timing
        if not timing.chunk_times:
            timing.error = "the stream sent [DONE] without a chunk"
            return timing
        timing.done_at = time.perf_counter()
        timing.output_tokens = timing.output_tokens or chunks
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    return timing


def _unfinished(finish_reason: str | None) -> str | None:
    """Why a request ended without its answer: fastgen's "abort" (the server shut down, say) and
    "error" (the request's step failed) are not completions."""
    return f"finish_reason {finish_reason!r}" if finish_reason in ("abort", "error") else None


async def plain_completion(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                           max_tokens: int, temperature: float) -> RequestTiming:
    """Send one completion with "stream": false and time it to its whole answer; errors are
    recorded, never raised."""
    timing = RequestTiming(prompt_len=len(prompt), streamed=False)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": False}
    timing.sent_at = time.perf_counter()
    try:
        response = await client.post(url, json=body)
        if response.status_code != 200:
            timing.error = f"HTTP {response.status_code}: {response.text[:200]}"
            return timing
        answer = response.json()
        timing.error = _unfinished(answer["choices"][0].get("finish_reason"))
        if timing.error is not None:
            return timing
        tokens = answer["usage"]["completion_tokens"]
        if not isinstance(tokens, int):
            timing.error = f"usage.completion_tokens={tokens!r} is not a count"
            return timing
        timing.done_at = time.perf_counter()
        timing.output_tokens = tokens
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
        timing.done_at = None
        timing.error = f"{type(exc).__name__}: {exc}"
    return timing
