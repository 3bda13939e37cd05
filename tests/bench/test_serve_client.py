"""`fastgen bench serve`'s client counts a request as completed only when the server answered it
whole: a stream that ends in an error event, without [DONE], or with fastgen's "abort" / "error"
finish reason is a failure, and so is such a plain answer."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from fastgen.bench.serve_client import plain_completion, stream_completion


def chunk(text: str, finish_reason: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]}


def sse(*events) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def timed(body: bytes, stream: bool = True):
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

    async def run():
        async with httpx.AsyncClient(transport=transport) as client:
            send = stream_completion if stream else plain_completion
            return await send(client, "http://server/v1/completions", "m", [1, 2, 3], 2, 0.0)

    return asyncio.run(run())


def test_a_whole_stream_is_completed_with_the_servers_token_count():
    timing = timed(sse(chunk("a"), chunk("b", "length"), {"choices": [], "usage": {"completion_tokens": 2}},
                       "[DONE]"))
    assert timing.ok and timing.output_tokens == 2 and len(timing.chunk_times) == 2


@pytest.mark.parametrize("body, says", [
    (sse(chunk("a"), {"error": {"message": "the engine is down"}}, "[DONE]"), "error event"),
    (sse(chunk("a"), chunk("b")), "without [DONE]"),
    (sse(chunk("a"), chunk("", "abort"), "[DONE]"), "finish_reason 'abort'"),
    (sse(chunk("a", "error"), "[DONE]"), "finish_reason 'error'"),
    (sse("[DONE]"), "[DONE] without a chunk"),
], ids=["error event", "cut off", "abort", "error", "empty"])
def test_a_stream_the_server_did_not_answer_whole_is_a_failure(body, says):
    timing = timed(body)
    assert not timing.ok and says in timing.error


def test_a_plain_answer_that_ended_in_error_is_a_failure():
    answer = {**chunk("a", "error"), "usage": {"completion_tokens": 1}}
    timing = timed(json.dumps(answer).encode(), stream=False)
    assert not timing.ok and "finish_reason 'error'" in timing.error
    answer = {**chunk("ab", "length"), "usage": {"completion_tokens": 2}}
    assert timed(json.dumps(answer).encode(), stream=False).ok


def test_requests_go_out_at_poisson_gaps_and_the_last_is_not_followed_by_one(monkeypatch):
    """Gaps between the requests only: a gap slept after the last one padded elapsed_s (and so
    understated every rate) by 1/request_rate on average. (The sleeps are recorded, not slept.)"""
    import numpy as np

    from fastgen.bench import serve_load
    from fastgen.bench.workload import IntRange, WorkloadSpec, build_workload

    workload = build_workload(WorkloadSpec(4, IntRange(2, 3), IntRange(1, 2), seed=0), 100)
    sent, slept = [], []

    async def send(client, url, model, prompt, output_len, temperature):
        sent.append(prompt)

    async def sleep(seconds):
        slept.append(seconds)

    monkeypatch.setattr(serve_load.asyncio, "sleep", sleep)
    rate, seed = 20.0, 8
    asyncio.run(serve_load._send_all(send, "http://server", "m", workload, rate, None, 5.0, 0.0, seed))
    assert sent == workload.prompts
    assert slept == np.random.default_rng(seed).exponential(1.0 / rate, size=3).tolist()  # 3 gaps for 4
