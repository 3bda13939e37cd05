"""A non-streaming client that gives up before its completion is done aborts its request: its
KV blocks are free at once and the finished-requests metric counts an "abort"."""

from __future__ import annotations

import time

import httpx
import pytest

from fastgen import LLM
from tests.serve.conftest import ENGINE_ARGS, MODEL_NAME, metric_values, running_server, wait_for

# Room for a request long enough (4 x 1000 tokens) to outlast the client's patience on any machine.
LONG = dict(ENGINE_ARGS, max_model_len=1024, num_kv_blocks=1024)
ABORTED = "fastgen_requests_finished_total{finish_reason=abort}"


@pytest.fixture(scope="module")
def server(chat_model):
    with running_server(LLM(chat_model, **LONG)) as base_url:
        yield base_url


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_non_streaming_client_that_disconnects_aborts_and_leaves_no_used_blocks(server, path):
    body = {"model": MODEL_NAME, "max_tokens": 1000, "n": 4, "temperature": 1.0, "ignore_eos": True}
    body.update({"prompt": "The quick brown fox"} if path == "/v1/completions"
                else {"messages": [{"role": "user", "content": "Hi"}]})
    aborts_before = metric_values(server).get(ABORTED, 0)
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 4 x 1000 tokens are made
        httpx.post(f"{server}{path}", json=body, timeout=httpx.Timeout(30, read=0.5))
    wait_for(lambda: metric_values(server).get(ABORTED, 0) == aborts_before + 1)
    wait_for(lambda: metric_values(server)["fastgen_kv_cache_blocks_used"] == 0)
    assert metric_values(server)["fastgen_num_requests_running"] == 0
    # Aborted, not run to its end: had it finished, it would have taken far longer than this.
    assert metric_values(server).get("fastgen_requests_finished_total{finish_reason=length}", 0) == 0, \
        f"the request ran to its end ({time.monotonic() - started:.1f} s)"
