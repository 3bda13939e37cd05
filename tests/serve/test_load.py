"""`fastgen serve` under a bounded load on loopback: 64 concurrent clients for 30 s mixing
streams read to the end, streams dropped mid-way, plain and structured requests, malformed JSON,
oversized bodies and wrong keys. Nothing is lost (every accepted request gets its final output,
or its client left), the KV blocks are all back at the end, the server's RSS stays flat after
warm-up, and /metrics agrees with what the clients saw."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.serve.conftest import metric_values, wait_for
from tests.serve.test_serve_cli import free_port, wait_until_serving

KEY = "load-test-key"
CLIENTS = 64
DURATION_S = 30.0
WARM_UP_S = 8.0
MAX_REQUEST_BYTES = 16 << 10
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


async def one_request(client: httpx.AsyncClient, rng: random.Random, seen: collections.Counter) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    prompt = [rng.randrange(1, 380) for _ in range(rng.randrange(2, 40))]
    body = {"prompt": prompt, "max_tokens": rng.randrange(1, 24), "temperature": rng.choice([0.0, 1.0])}
    kind = rng.choice(["stream", "stream", "drop", "plain", "plain", "structured", "bad_json", "oversized",
                       "wrong_key"])
    if kind == "bad_json":
        headers = {**auth, "Content-Type": "application/json"}
        response = await client.post("/v1/completions", content=b"{nope", headers=headers)
        assert response.status_code == 400, response.text
    elif kind == "oversized":
        response = await client.post("/v1/completions", json={**body, "stop": ["x" * MAX_REQUEST_BYTES]}, headers=auth)
        assert response.status_code == 413, response.text
    elif kind == "wrong_key":
        response = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert response.status_code == 401, response.text
    elif kind in ("plain", "structured"):
        if kind == "structured":
            body = {**body, "max_tokens": 200, "structured_outputs": {"json": SCHEMA}}
        response = await client.post("/v1/completions", json=body, headers=auth)
        if response.status_code == 503:
            kind = "overloaded"
        else:
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True, "max_tokens": 24},
                                 headers=auth) as response:
            if response.status_code == 503:
                kind = "overloaded"
            else:
                assert response.status_code == 200
                finish = None
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        choices = json.loads(line[6:])["choices"]
                        finish = finish or (choices[0]["finish_reason"] if choices else None)
                        if kind == "drop":
                            break  # the client leaves mid-stream
                    elif line == "data: [DONE]":
                        assert finish in ("stop", "length")
                if kind == "drop" and finish is not None:
                    kind = "stream"  # its one chunk was the last: it finished before we left
    seen[kind] += 1


async def client_loop(base_url: str, seed: int, deadline: float, seen: collections.Counter) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        while time.monotonic() < deadline:
            await one_request(client, rng, seen)


@pytest.mark.slow
@pytest.mark.alone
def test_sixty_four_clients_for_thirty_seconds(chat_model):
    pytest.importorskip("xgrammar")
    port = free_port()
    cmd = [sys.executable, "-m", "fastgen", "serve", "--model", chat_model, "--port", str(port), "--dtype", "float32",
           "--block-size", "8", "--num-kv-blocks", "256", "--max-model-len", "256", "--max-num-seqs", "32",
           "--max-waiting-requests", "48", "--max-request-bytes", str(MAX_REQUEST_BYTES), "--api-key", KEY]
    proc = subprocess.Popen(cmd, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, stderr=subprocess.PIPE, text=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, base_url)
        server = psutil.Process(proc.pid)
        seen: collections.Counter = collections.Counter()

        async def run():
            start = time.monotonic()
            tasks = [asyncio.create_task(client_loop(base_url, seed, start + DURATION_S, seen))
                     for seed in range(CLIENTS)]
            await asyncio.sleep(WARM_UP_S)
            rss_warm = server.memory_info().rss
            await asyncio.gather(*tasks)
            return rss_warm

        rss_warm = asyncio.run(run())
        accepted = seen["stream"] + seen["plain"] + seen["structured"] + seen["drop"]

        def finished_by_reason(values: dict) -> dict:
            return {reason: values.get(f"fastgen_requests_finished_total{{finish_reason={reason}}}", 0)
                    for reason in ("stop", "length", "abort", "error")}

        # The server counts a dropped stream a moment after its client left: wait for the books.
        values = wait_for(lambda: (v := metric_values(base_url))["fastgen_num_requests_running"] == 0
                          and v["fastgen_num_requests_waiting"] == 0
                          and sum(finished_by_reason(v).values()) >= accepted and v, timeout=60)
        rss_end = server.memory_info().rss
        finished = finished_by_reason(values)
        print(f"\nrequests by outcome: {dict(seen)}; finished by reason (metrics): {finished}; "
              f"RSS warm {rss_warm / 2**20:.0f} MiB, end {rss_end / 2**20:.0f} MiB; "
              f"KV blocks used at the end: {values['fastgen_kv_cache_blocks_used']:.0f}")
        assert sum(seen.values()) >= 500 and all(seen[k] > 0 for k in ("stream", "drop", "plain", "structured",
                                                                         "bad_json", "oversized", "wrong_key"))
        assert values["fastgen_kv_cache_blocks_used"] == 0
        assert finished["error"] == 0
        # Every accepted request ended exactly once: read to its end, or aborted when its client
        # left (a dropped stream whose final output was made before the server saw it go counts as
        # finished, not aborted).
        assert finished["stop"] + finished["length"] + finished["abort"] == accepted
        assert finished["stop"] + finished["length"] >= seen["stream"] + seen["plain"] + seen["structured"]
        assert 0 < finished["abort"] <= seen["drop"]
        assert rss_end - rss_warm < 64 << 20, (rss_warm, rss_end)
        assert httpx.get(f"{base_url}/health").status_code == 200
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
