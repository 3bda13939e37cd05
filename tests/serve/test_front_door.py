"""The server's front door: the API key, body size, connection count, idle streams and list
limits, each answered as documented while the server goes on serving."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from fastgen import LLM
from fastgen.serve.app import ServerSettings
from tests.serve.conftest import ENGINE_ARGS, MODEL_NAME, metric_values, running_server, wait_for

KEY = "s3cret-key-for-tests"
OK = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 2, "temperature": 0.0}


@pytest.fixture(scope="module")
def llm(chat_model):
    return LLM(chat_model, **{**ENGINE_ARGS, "max_model_len": 1024})


def test_an_api_key_guards_every_route_but_health_and_metrics(llm, caplog):
    import openai

    with caplog.at_level(logging.DEBUG), running_server(llm, api_key=KEY) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
            response = httpx.post(f"{url}/v1/completions", json=OK, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
            assert KEY not in response.text
        for path in ("/v1/models", "/result/0"):
            assert httpx.get(f"{url}{path}").status_code == 401
        for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme's name is case-insensitive
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert client.completions.create(**OK).choices[0].finish_reason == "length"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).completions.create(**OK)
    with running_server(llm, api_key=KEY, metrics_require_key=True) as url:
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert KEY not in caplog.text and KEY not in repr(ServerSettings(api_key=KEY))


def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(llm):
    with running_server(llm, max_request_bytes=2000) as url:
        big = {**OK, "prompt": "x" * 3000}
        response = httpx.post(f"{url}/v1/completions", json=big)
        assert response.status_code == 413 and "max_request_bytes=2000" in response.json()["error"]["message"]

        def chunks():  # no Content-Length: counted as it arrives
            body = json.dumps(big).encode()
            for i in range(0, len(body), 500):
                yield body[i:i + 500]

        response = httpx.post(f"{url}/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert response.status_code == 413
        assert httpx.post(f"{url}/v1/completions", json=OK).status_code == 200


def test_connections_beyond_the_limit_get_503(llm):
    with running_server(llm, max_connections=3) as url:
        port = int(url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        try:
            time.sleep(0.3)
            assert httpx.post(f"{url}/v1/completions", json=OK).status_code == 200  # the third is served
            idle.append(socket.create_connection(("127.0.0.1", port)))
            time.sleep(0.3)
            assert httpx.post(f"{url}/v1/completions", json=OK).status_code == 503  # the fourth is not
        finally:
            for sock in idle:
                sock.close()
        wait_for(lambda: httpx.post(f"{url}/v1/completions", json=OK).status_code == 200)


def test_a_stream_nobody_reads_is_aborted_after_the_idle_timeout(llm):
    with running_server(llm, send_buffer_bytes=4096, stream_idle_timeout_s=1.0) as url:
        port = int(url.rsplit(":", 1)[1])
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
        sock.connect(("127.0.0.1", port))
        body = json.dumps({"model": MODEL_NAME, "prompt": "The quick", "max_tokens": 900, "ignore_eos": True,
                           "n": 8, "logprobs": 5, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        try:
            wait_for(lambda: metric_values(url).get("fastgen_requests_finished_total{finish_reason=abort}", 0) >= 1,
                     timeout=60)
            values = wait_for(lambda: (v := metric_values(url))["fastgen_num_requests_running"] == 0 and v)
            assert values.get("fastgen_requests_finished_total{finish_reason=length}", 0) == 0
            assert values["fastgen_generation_tokens_total"] < 8 * 900  # cut short: aborted while it ran
        finally:
            sock.close()
        assert httpx.post(f"{url}/v1/completions", json=OK).status_code == 200


@pytest.mark.parametrize("extra, param", [
    ({"n": 129}, "n"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"stop": ["x" * 1025]}, "stop"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
])
def test_lists_over_the_limits_are_400s(server, extra, param):
    response = httpx.post(f"{server}/v1/completions", json={**OK, **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_too_many_tools_is_a_400(server):
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    response = httpx.post(f"{server}/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "tools": tools})
    assert response.status_code == 400 and "more than 128" in response.json()["error"]["message"]


@pytest.mark.parametrize("value", [0, -1, None, 2.5])
def test_max_connections_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match=rf"max_connections={value!r} must be"):
        ServerSettings(max_connections=value)


def test_an_empty_api_key_is_refused_not_taken_for_no_key(monkeypatch, capsys, tiny_models):
    from fastgen.cli.main import main

    with pytest.raises(ValueError, match="api_key is empty"):
        ServerSettings(api_key="  ")
    monkeypatch.setenv("FASTGEN_API_KEY", "")
    assert main(["serve", "--model", tiny_models["qwen3"], "--device", "cpu"]) == 2
    assert "api_key is empty" in capsys.readouterr().err
