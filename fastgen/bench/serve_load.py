"""The load `fastgen bench serve` puts on a server, and the results it reports.

Like `vllm bench serve`: requests arrive as a Poisson process at `request_rate` (or all at once),
at most `max_concurrency` in flight, each a streamed /v1/completions (`serve_client`) of one
workload prompt that generates exactly its output length. The results are TTFT, TPOT,
inter-token and end-to-end latency percentiles, request and token throughput, and goodput: the
rate of requests that met every SLO bound. Kept apart from the command line so the measurement
can be read, and tested, on its own.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

import httpx
import numpy as np

from fastgen.bench.serve_client import RequestTiming, plain_completion, stream_completion
from fastgen.bench.stats import ms, summarize_ms
from fastgen.bench.workload import Workload


def served_model(base_url: str, model: str | None, vocab_size: int | None) -> tuple[str, int]:
    """The model to request (the first /v1/models lists when model is None) and the vocabulary
    prompts are drawn from (vocab_size, else what the server reports). Raises httpx.HTTPError
    when the server cannot be read, ValueError when the model or a vocabulary size is missing."""
    models = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]
    entry = next((m for m in models if model is None or m["id"] == model), None)
    if entry is None:
        raise ValueError(f"--model {model!r} is not among the server's models {[m['id'] for m in models]}")
    vocab = vocab_size or entry.get("vocab_size")
    if vocab is None:
        raise ValueError("--vocab-size is needed: the server's /v1/models does not report a vocab_size")
    return entry["id"], vocab


def measure_serve(url: str, model: str, workload: Workload, *, request_rate: float, max_concurrency: int | None,
                  timeout_s: float, temperature: float, seed: int, slo: dict[str, float] | None,
                  stream: bool = True, per_request: bool = False) -> dict:
    """Send the workload to the completions endpoint `url`; the `results` section of a serve
    report. seed draws the arrival times; slo: bounds in ms by "ttft", "tpot", "e2e" (or None);
    stream: streamed requests, else plain ones (timed to their whole answer; ValueError for an
    slo on the TTFT or TPOT they do not measure); per_request: also a record per request."""
    unmeasured = sorted(set(slo or {}) - {"e2e"})
    if not stream and unmeasured:
        raise ValueError(f"slo bounds {unmeasured}, which plain requests (--no-stream) do not measure: bound e2e only")
    start = time.perf_counter()
    send = stream_completion if stream else plain_completion
    timings = asyncio.run(_send_all(send, url, model, workload, request_rate, max_concurrency, timeout_s,
                                    temperature, seed))
    results = results_of(timings, time.perf_counter() - start, slo)
    if per_request:
        results["requests"] = request_records(timings)
    return results


def request_records(timings: list[RequestTiming]) -> list[dict]:
    """One record a request, in workload order, as the engine benchmarks write them (ms; None
    where unmeasured: a failed request, a plain request's TTFT and TPOT), with its error."""
    return [{"input_len": t.prompt_len, "output_len": t.output_tokens if t.ok else 0, "ttft_ms": ms(t.ttft),
             "tpot_ms": ms(t.tpot), "e2e_ms": ms(t.e2e), "error": t.error} for t in timings]


async def _send_all(send: Callable[..., Awaitable[RequestTiming]], url: str, model: str, workload: Workload,
                    request_rate: float, max_concurrency: int | None, timeout_s: float, temperature: float,
                    seed: int) -> list[RequestTiming]:
    rng = np.random.default_rng(seed)
    in_flight = max_concurrency or len(workload.prompts)
    limit = asyncio.Semaphore(in_flight)
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        async def one(prompt, output_len):
            async with limit:
                return await send(client, url, model, prompt, output_len, temperature)

        tasks = []
        for i, (prompt, output_len) in enumerate(zip(workload.prompts, workload.output_lens)):
            if i and math.isfinite(request_rate) and request_rate > 0:  # a gap between requests, none after
                await asyncio.sleep(rng.exponential(1.0 / request_rate))  # the last (it would pad elapsed_s)
            tasks.append(asyncio.create_task(one(prompt, output_len)))
        return list(await asyncio.gather(*tasks))


def _meets(t: RequestTiming, slo: dict[str, float]) -> bool:
    measured = {"ttft": t.ttft, "tpot": t.tpot, "e2e": t.e2e}
    return t.ok and all(measured[k] is None or measured[k] * 1000.0 <= bound for k, bound in slo.items())


def results_of(timings: list[RequestTiming], elapsed: float, slo: dict | None) -> dict:
    """The results of requests that took `elapsed` seconds in all (failed ones only counted)."""
    ok = [t for t in timings if t.ok]
    prompt_tokens = sum(t.prompt_len for t in ok)
    output_tokens = sum(t.output_tokens for t in ok)
    return {
        "elapsed_s": elapsed,
        "num_requests": len(timings),
        "num_completed": len(ok),
        "num_failed": len(timings) - len(ok),
        "errors": sorted({t.error for t in timings if t.error})[:5],
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(ok) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "ttft_ms": summarize_ms(t.ttft for t in ok),
        "tpot_ms": summarize_ms(t.tpot for t in ok),
        "itl_ms": summarize_ms(x for t in ok for x in t.itls),
        "e2e_latency_ms": summarize_ms(t.e2e for t in ok),
        "slo_ms": slo,
        "goodput_requests_per_s": None if slo is None else sum(_meets(t, slo) for t in ok) / elapsed,
    }
