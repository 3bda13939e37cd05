"""Each bad request gets its own 400 (404 for an unknown model) with an OpenAI-style error body
naming the field; fields outside the schema are ignored; the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.conftest import MODEL_NAME

OK = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0.0}
CHAT_OK = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


BAD = [
    ("/v1/completions", {**OK, "temperature": "hot"}, "temperature", "hot"),
    ("/v1/completions", {**OK, "temperature": -1.0}, "temperature", "-1"),
    ("/v1/completions", {**OK, "top_p": 0.0}, "top_p", "(0, 1]"),
    ("/v1/completions", {**OK, "max_tokens": 0}, "max_tokens", ">= 1"),
    ("/v1/completions", {**OK, "max_tokens": 1000}, "prompt", "max_model_len=256"),
    ("/v1/completions", {**OK, "prompt": "x " * 300}, "prompt", "max_model_len=256"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [5] * 256}, "prompt", "leaves no room for a token"),
    ("/v1/completions", {**OK, "prompt": [1, 2, 999999]}, "prompt", "vocabulary"),
    ("/v1/completions", {**OK, "prompt": ["a", "b"]}, "prompt", "one prompt"),
    ("/v1/completions", {**OK, "suffix": "!"}, "suffix", "not supported"),
    ("/v1/completions", {**OK, "best_of": 2}, "best_of", "not supported"),
    ("/v1/completions", {"model": MODEL_NAME}, "prompt", "Field required"),
    ("/v1/completions", {**OK, "stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
    ("/v1/chat/completions", {**CHAT_OK, "functions": [{"name": "f"}]}, "functions", "not supported"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": []}, "messages", "at least 1"),
    ("/v1/chat/completions", {**CHAT_OK, "max_completion_tokens": -3}, "max_completion_tokens",
     "max_completion_tokens=-3 must be >= 1"),
    ("/v1/chat/completions", {**CHAT_OK, "max_completion_tokens": 10**6}, "max_completion_tokens",
     "max_completion_tokens 1000000 = "),
    ("/v1/chat/completions", {**CHAT_OK, "max_tokens": 0}, "max_tokens", "max_tokens=0 must be >= 1"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content", "text only"),
    ("/generate", {"prompt": "hi", "stop": [""]}, "stop", "non-empty"),
    # Valid JSON, not Unicode: a lone UTF-16 surrogate (tokenizers refuse it with a TypeError).
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi \ud800"}, "prompt", "lone surrogate"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": "hi \ud800"}]}, "messages",
     "lone surrogate"),
    ("/tokenize", {"prompt": "hi \ud800"}, "prompt", "lone surrogate"),
    ("/generate", {"prompt": "hi \ud800"}, "prompt", "lone surrogate"),
    # Too long to fit whatever it tokenizes to: refused before it is tokenized (seconds of the GIL).
    ("/v1/completions", {**OK, "prompt": "ab " * 400_000}, "prompt", "cannot fit in max_model_len=256"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "ab " * 400_000}, "prompt", "cannot fit in"),
]


@pytest.mark.parametrize(("path", "body", "param", "says"), BAD, ids=[f"{b[0]}:{b[2]}" for b in BAD])
def test_a_bad_request_is_a_400_naming_its_field_and_the_server_goes_on(server, path, body, param, says):
    # json.dumps escapes non-ASCII (httpx's json= would not: a lone surrogate has no UTF-8).
    response = httpx.post(f"{server}{path}", content=json.dumps(body), timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert says in error["message"]
    assert httpx.post(f"{server}/v1/completions", json=OK, timeout=30).status_code == 200


def test_bad_json_is_a_400(server):
    response = httpx.post(f"{server}/v1/completions", content=b"{not json", timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


def test_an_unknown_model_is_a_404(server):
    response = httpx.post(f"{server}/v1/completions", json={**OK, "model": "gpt-9"}, timeout=30)
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


def test_an_unknown_path_or_method_is_an_openai_shaped_error(server):
    response = httpx.get(f"{server}/v1/nothing", timeout=30)
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "GET /v1/nothing: Not Found"
    response = httpx.get(f"{server}/v1/completions", timeout=30)
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_fields_outside_the_schema_are_ignored_with_a_warning(server, caplog):
    with caplog.at_level("WARNING", logger="fastgen.serve.sampling"):
        response = httpx.post(f"{server}/v1/completions", json={**OK, "frobnicate": 3}, timeout=30)
    assert response.status_code == 200
    assert "frobnicate" in caplog.text


def test_harmless_values_of_unsupported_fields_are_accepted(server):
    body = {**OK, "echo": False, "best_of": 1, "logit_bias": {}, "response_format": {"type": "text"}}
    assert httpx.post(f"{server}/v1/completions", json=body, timeout=30).status_code == 200


@pytest.mark.parametrize("prompt_len, expected", [(10, 16), (250, 6)])
def test_a_completion_without_max_tokens_gets_16_or_what_the_context_leaves(server, prompt_len, expected):
    body = {"model": MODEL_NAME, "prompt": [5] * prompt_len, "ignore_eos": True, "temperature": 0.0}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == expected
