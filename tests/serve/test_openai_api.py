"""The OpenAI-compatible API, driven by the real `openai` client: greedy text equals
LLM.generate (completions and chat, plain and streaming), usage counts, 32 concurrent streams,
a dropped stream frees its blocks, /v1/models."""

from __future__ import annotations

import asyncio
import os
import threading

import httpx
import pytest

if os.environ.get("FASTGEN_NO_SERVER_STACK") == "1":  # see tests/serve/conftest.py
    openai = pytest.importorskip("openai")
else:
    import openai

from fastgen import LLM, SamplingParams  # noqa: E402
from fastgen.engine.prompts import chat_token_ids  # noqa: E402
from tests.serve.conftest import ENGINE_ARGS, MODEL_NAME, metric_values, wait_for  # noqa: E402

PROMPTS = ["The quick brown fox", "Paged attention keeps", "def fibonacci(n):"]
MAX_TOKENS = 12
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Prefix caching shares"}]


@pytest.fixture(scope="module")
def expected(chat_model):
    """What LLM.generate gives on a separate engine (greedy, ignore_eos)."""
    llm = LLM(chat_model, **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    completions = {p: o for p, o in zip(PROMPTS, llm.generate(PROMPTS, params))}
    chat = llm.generate([chat_token_ids(llm.tokenizer, CHAT)], params)[0]
    return completions, chat


GREEDY = dict(model=MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_text_equals_generate(client, expected, prompt):
    want = expected[0][prompt]
    response = client.completions.create(prompt=prompt, **GREEDY)
    assert response.choices[0].text == want.text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(want.prompt_token_ids)
    assert response.usage.completion_tokens == MAX_TOKENS


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_completion_greedy_text_equals_generate(client, expected, prompt):
    chunks = list(client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True},
                                            **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected[0][prompt].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_completion_of_token_ids_equals_generate(client, expected):
    want = expected[0][PROMPTS[0]]
    response = client.completions.create(prompt=want.prompt_token_ids, **GREEDY)
    assert response.choices[0].text == want.text


def test_chat_greedy_text_equals_generate(client, expected):
    response = client.chat.completions.create(messages=CHAT, **GREEDY)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected[1].text
    assert response.usage.prompt_tokens == len(expected[1].prompt_token_ids)
    assert response.usage.completion_tokens == MAX_TOKENS


def test_streamed_chat_greedy_text_equals_generate(client, expected):
    chunks = list(client.chat.completions.create(messages=CHAT, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected[1].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_stop_string_ends_the_completion_with_stop(client, expected):
    want = expected[0][PROMPTS[1]].text
    stop = want[4:7]
    response = client.completions.create(prompt=PROMPTS[1], stop=[stop], **GREEDY)
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].text == want[: want.index(stop)]


def test_only_streamed_responses_ask_the_engine_for_an_output_every_step(client, expected, monkeypatch):
    """A response sent whole is submitted final-only: the engine makes one output for it, not one
    a step that the event loop would wake up for."""
    from fastgen.engine.async_llm import AsyncLLM

    asked, submit = [], AsyncLLM.submit

    async def spy(self, prompt, params=None, final_only=False):
        asked.append(final_only)
        return await submit(self, prompt, params, final_only)

    monkeypatch.setattr(AsyncLLM, "submit", spy)
    whole = client.completions.create(prompt=PROMPTS[0], **GREEDY)
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=PROMPTS[0], stream=True, **GREEDY))
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(messages=messages, **GREEDY)
    streamed_chat = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        messages=messages, stream=True, **GREEDY) if c.choices)
    assert asked == [True, False, True, False]
    assert whole.choices[0].text == streamed == expected[0][PROMPTS[0]].text
    assert chat.choices[0].message.content == streamed_chat


def test_long_prompts_are_tokenized_once_off_the_event_loop(server, client, chat_model, expected, monkeypatch):
    """The event loop serves every stream: a long prompt's tokenization (milliseconds, holding
    the thread) runs in a worker thread, neither there nor in the engine's loop thread; a short
    one where it costs less than the hand-over, on the event loop. A completion's text is encoded
    once (for its length and for the engine alike)."""
    from fastgen.engine.tokenizer import FastTokenizer

    calls, encode = [], FastTokenizer.encode

    def spy(self, text, *args, **kwargs):
        try:
            asyncio.get_running_loop()
            where = "event loop"
        except RuntimeError:
            where = threading.current_thread().name
        calls.append((text, where))
        return encode(self, text, *args, **kwargs)

    long = "fibonacci " * 102  # past the 1,000 characters made ready inline, in 105 tokens
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = LLM(chat_model, **ENGINE_ARGS).generate(long, params)[0]
    monkeypatch.setattr(FastTokenizer, "encode", spy)
    completion = client.completions.create(prompt=long, **GREEDY)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": long}], **GREEDY)
    counted = httpx.post(f"{server}/tokenize", json={"prompt": long}).json()
    short = client.completions.create(prompt=PROMPTS[1], **GREEDY)
    assert completion.choices[0].text == want.text and counted["tokens"] == want.prompt_token_ids
    assert completion.usage.prompt_tokens == len(want.prompt_token_ids) and chat.choices[0].finish_reason == "length"
    assert short.choices[0].text == expected[0][PROMPTS[1]].text
    assert [text for text, _ in calls].count(long) == 2  # the completion's once, /tokenize's
    assert len(calls) == 4, calls
    assert not {where for _, where in calls[:3]} & {"event loop", "fastgen-engine-loop"}, calls
    assert calls[3] == (PROMPTS[1], "event loop")


def test_32_concurrent_streaming_clients_finish_with_correct_token_counts(server, expected):
    async def one(client, i):
        stream = await client.completions.create(
            prompt=PROMPTS[i % len(PROMPTS)], stream=True, stream_options={"include_usage": True},
            model=MODEL_NAME, max_tokens=8 + i % 5, temperature=0.0, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    for i, (text, count) in enumerate(results):
        assert count == 8 + i % 5
        if count == MAX_TOKENS:
            assert text == expected[0][PROMPTS[i % len(PROMPTS)]].text


def test_a_client_dropped_mid_stream_aborts_and_leaves_no_used_blocks(server):
    body = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 240, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    aborted = "fastgen_requests_finished_total{finish_reason=abort}"
    aborts_before = metric_values(server).get(aborted, 0)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert metric_values(server)["fastgen_kv_cache_blocks_used"] > 0
    # The connection closed mid-stream: the request is aborted and its blocks freed.
    wait_for(lambda: metric_values(server).get(aborted, 0) == aborts_before + 1)
    wait_for(lambda: metric_values(server)["fastgen_kv_cache_blocks_used"] == 0)
    assert metric_values(server)["fastgen_num_requests_running"] == 0


def test_health_is_ok(server):
    assert httpx.get(f"{server}/health").status_code == 200


def test_n_completions_come_as_n_choices(client):
    response = client.completions.create(prompt=PROMPTS[0], n=3, seed=7, model=MODEL_NAME, max_tokens=6,
                                         temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert response.usage.completion_tokens == 18


def test_penalties_and_min_p_map_from_their_openai_names(client, expected):
    response = client.completions.create(prompt=PROMPTS[0], presence_penalty=0.0, frequency_penalty=0.0,
                                         **{**GREEDY, "extra_body": {"ignore_eos": True, "min_p": 0.0,
                                                                     "repetition_penalty": 1.0, "min_tokens": 2}})
    assert response.choices[0].text == expected[0][PROMPTS[0]].text
    bad = httpx.post(f"{client.base_url}completions".replace("/v1completions", "/v1/completions"),
                     json={"model": MODEL_NAME, "prompt": "hi", "presence_penalty": 5.0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "presence_penalty"
