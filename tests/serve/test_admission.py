"""Beyond max_waiting_requests a request is refused at once with 503 and Retry-After."""

from __future__ import annotations

import httpx

from fastgen import LLM
from tests.serve.conftest import ENGINE_ARGS, running_server, wait_for

LONG = {"prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0.0, "ignore_eos": True}


def test_a_request_beyond_the_waiting_cap_gets_a_503_with_retry_after(chat_model):
    llm = LLM(chat_model, **ENGINE_ARGS, max_num_seqs=1, max_waiting_requests=1)
    with running_server(llm, retry_after_s=3) as server:
        running = httpx.post(f"{server}/generate", json=LONG).json()["seq_id"]
        wait_for(lambda: httpx.get(f"{server}/result/{running}").json()["status"] == "running")
        waiting = httpx.post(f"{server}/generate", json=LONG)  # max_num_seqs=1: it waits
        assert waiting.status_code == 200
        refused = httpx.post(f"{server}/v1/completions", json={**LONG, "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        assert refused.headers["Retry-After"] == "3"
        assert "max_waiting_requests=1" in refused.json()["error"]["message"]
        wait_for(lambda: httpx.get(f"{server}/result/{waiting.json()['seq_id']}").json()["status"] == "finished",
                 timeout=60)
        assert httpx.post(f"{server}/v1/completions", json={**LONG, "max_tokens": 2}).status_code == 200
