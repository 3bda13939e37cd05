"""Shutting down with requests in flight: they may finish until the shutdown timeout, /generate's
too; then each unfinished request is aborted and still answered (a whole response, a stream's
final chunk and [DONE]), with finish_reason "abort", not cut off by the server's own
cancellation."""

from __future__ import annotations

import json
import threading
import time

import httpx

from fastgen import LLM
from tests.serve.conftest import ENGINE_ARGS, MODEL_NAME, metric_values, running_server, wait_for


def test_requests_unfinished_at_the_shutdown_timeout_end_with_abort(chat_model):
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "temperature": 0.0}
    answers = {}

    def plain(base_url):
        answers["plain"] = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)

    def streamed(base_url):
        with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            answers["stream"] = [line for line in r.iter_lines() if line]

    start = None
    with running_server(LLM(chat_model, **ENGINE_ARGS), shutdown_timeout_s=0.0) as base_url:
        threads = [threading.Thread(target=target, args=(base_url,)) for target in (plain, streamed)]
        for thread in threads:
            thread.start()
        wait_for(lambda: metric_values(base_url)["fastgen_num_requests_running"] == 2)
        start = time.monotonic()  # leaving the block shuts the server down
    for thread in threads:
        thread.join(30)
    assert time.monotonic() - start < 5

    plain_answer = answers["plain"]
    assert plain_answer.status_code == 200, plain_answer.text
    choice = plain_answer.json()["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert plain_answer.json()["usage"]["completion_tokens"] < 240

    lines = answers["stream"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"


def test_a_request_that_reaches_the_engine_after_the_abort_is_aborted_too(chat_model):
    """A request admitted before the shutdown may reach the engine after the abort (its grammar
    took long to compile): it is aborted there, and still answered."""
    import asyncio

    from fastgen import SamplingParams
    from fastgen.engine.async_llm import AsyncLLM
    from fastgen.serve.results import ResultStore
    from fastgen.serve.state import ServerState

    async def main():
        llm = AsyncLLM(LLM(chat_model, **ENGINE_ARGS))
        state = ServerState(llm, MODEL_NAME, None, 256, 384, 20, ResultStore())
        try:
            state.abort_unfinished()
            stream = await state.submit([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
            outputs = [output async for output in stream]
            return outputs[-1]
        finally:
            await asyncio.to_thread(llm.shutdown)

    final = asyncio.run(main())
    assert final.finish_reason == "abort" and len(final.token_ids) < 200


def test_a_generate_request_in_flight_at_shutdown_gets_the_same_time_to_finish(chat_model):
    """/generate's requests hold no connection open, yet the shutdown waits for them as for the
    others, instead of aborting them at once."""
    llm = LLM(chat_model, **ENGINE_ARGS)
    body = {"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "temperature": 0.0}
    with running_server(llm, shutdown_timeout_s=60.0) as base_url:
        assert httpx.post(f"{base_url}/generate", json=body, timeout=30).status_code == 200
        wait_for(lambda: metric_values(base_url)["fastgen_num_requests_running"] == 1)
    assert llm.engine.stats().decode_tokens == 199  # its first token came from the prompt's step
