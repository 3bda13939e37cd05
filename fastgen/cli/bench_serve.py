"""`fastgen bench serve`: an online benchmark against any OpenAI-compatible endpoint.

Like `vllm bench serve`: requests arrive as a Poisson process at --request-rate (or all at
once), at most --max-concurrency in flight, each a streamed /v1/completions of a random
token-id prompt (with a shared prefix of --prefix-len tokens) that generates exactly its output
length. Reports TTFT, TPOT, inter-token latency and end-to-end latency percentiles, request and
token throughput, and goodput: the rate of requests that met every --slo bound.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from typing import TYPE_CHECKING

from fastgen.cli import arg_types
from fastgen.cli.bench_common import add_output_args
from fastgen.cli.help_format import HelpFormatter

if TYPE_CHECKING:  # numpy and httpx load when the benchmark runs, not for --help
    from fastgen.bench.serve_client import RequestTiming

DESCRIPTION = """\
Benchmark a running OpenAI-compatible server (fastgen's own, or another engine's): send streamed
completions of random token-id prompts at a Poisson request rate or a fixed concurrency, and
report TTFT, TPOT, inter-token and end-to-end latency percentiles, throughput and goodput."""

EPILOG = """\
examples:
  fastgen serve &                      # then:
  fastgen bench serve --num-prompts 64 --request-rate 4 --input-len 128 --output-len 64
  fastgen bench serve --max-concurrency 8 --prefix-len 256 --slo ttft=500,tpot=50 --output-json serve.json"""

SLO_KEYS = ("ttft", "tpot", "e2e")


def slo_spec(text: str) -> dict[str, float]:
    """`ttft=500,tpot=50` (milliseconds) -> {"ttft": 500.0, "tpot": 50.0}."""
    slo = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in SLO_KEYS:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: {key.strip()!r} is not one of {list(SLO_KEYS)}")
        slo[key.strip()] = arg_types.non_negative_float(value)
    return slo


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="online benchmark of an OpenAI-compatible server",
                                   description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's address")
    target.add_argument("--model", default=None, help="model name to request (default: the first /v1/models lists)")
    target.add_argument("--vocab-size", metavar="N", type=arg_types.positive_int, default=None,
                        help="vocabulary prompts are drawn from (default: what fastgen's /v1/models reports)")
    target.add_argument("--timeout", metavar="S", type=arg_types.non_negative_float, default=600.0,
                        help="seconds one request may take")
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", metavar="N", type=arg_types.positive_int, default=64, help="requests to send")
    group.add_argument("--input-len", metavar="N|MIN:MAX", type=arg_types.int_range(1), default="128",
                       help="prompt tokens after the shared prefix (uniform in MIN:MAX)")
    group.add_argument("--output-len", metavar="N|MIN:MAX", type=arg_types.int_range(1), default="64",
                       help="tokens each request generates (uniform in MIN:MAX)")
    group.add_argument("--prefix-len", metavar="N", type=arg_types.non_negative_int, default=0,
                       help="tokens every prompt shares at its start (0: fully random prompts)")
    group.add_argument("--request-rate", metavar="R", type=arg_types.non_negative_float, default=math.inf,
                       help="requests per second, Poisson arrivals (inf: all at once)")
    group.add_argument("--max-concurrency", metavar="N", type=arg_types.positive_int, default=None,
                       help="most requests in flight (default: no limit)")
    group.add_argument("--temperature", metavar="T", type=arg_types.non_negative_float, default=0.0,
                       help="sampling temperature; 0 is greedy")
    group.add_argument("--seed", metavar="N", type=arg_types.non_negative_int, default=0,
                       help="seed of the prompts and of the arrival times")
    group.add_argument("--slo", metavar="ttft=MS,tpot=MS", type=slo_spec, default=None,
                       help="latency bounds in ms (ttft, tpot, e2e) for goodput")
    add_output_args(parser)
    parser.set_defaults(run=run, parser=parser)
    return parser


def _served_model(base_url: str, model: str | None, vocab_size: int | None) -> tuple[str, int]:
    import httpx

    models = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]
    entry = next((m for m in models if model is None or m["id"] == model), None)
    if entry is None:
        raise ValueError(f"--model {model!r} is not among the server's models {[m['id'] for m in models]}")
    vocab = vocab_size or entry.get("vocab_size")
    if vocab is None:
        raise ValueError("--vocab-size is needed: the server's /v1/models does not report a vocab_size")
    return entry["id"], vocab


async def _run_all(args, url: str, model: str, prompts: list[list[int]], output_lens: list[int]) -> list[RequestTiming]:
    import httpx
    import numpy as np

    from fastgen.bench.serve_client import stream_completion

    rng = np.random.default_rng(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    limits = httpx.Limits(max_connections=args.max_concurrency or len(prompts), max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        async def one(prompt, output_len):
            async with limit:
                return await stream_completion(client, url, model, prompt, output_len, args.temperature)

        tasks = []
        for prompt, output_len in zip(prompts, output_lens):
            tasks.append(asyncio.create_task(one(prompt, output_len)))
            if math.isfinite(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        return list(await asyncio.gather(*tasks))


def _meets(t: RequestTiming, slo: dict[str, float]) -> bool:
    measured = {"ttft": t.ttft, "tpot": t.tpot, "e2e": t.e2e}
    return t.ok and all(measured[k] is None or measured[k] * 1000.0 <= bound for k, bound in slo.items())


def results_of(timings: list[RequestTiming], elapsed: float, slo: dict | None) -> dict:
    from fastgen.bench.stats import summarize_ms

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


def run(args: argparse.Namespace) -> int:
    import httpx
    import torch

    from fastgen.bench.environment import environment_info
    from fastgen.bench.report import emit, make_report
    from fastgen.bench.workload import WorkloadSpec, build_workload

    base_url = args.base_url.rstrip("/")
    try:
        model, vocab = _served_model(base_url, args.model, args.vocab_size)
    except httpx.HTTPError as exc:
        raise ValueError(f"--base-url {base_url}: cannot read /v1/models ({exc})") from None
    spec = WorkloadSpec(args.num_prompts, args.input_len, args.output_len, args.prefix_len, args.seed)
    workload = build_workload(spec, vocab)
    if not args.quiet:
        print(f"sending {args.num_prompts} requests to {base_url} ({model}) at "
              f"{args.request_rate} req/s", file=sys.stderr, flush=True)
    start = time.perf_counter()
    timings = asyncio.run(_run_all(args, f"{base_url}/v1/completions", model, workload.prompts,
                                   workload.output_lens))
    results = results_of(timings, time.perf_counter() - start, args.slo)
    workload_json = {**spec.to_json(), "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
                     "max_concurrency": args.max_concurrency, "temperature": args.temperature}
    endpoint = {"base_url": base_url, "model": model, "vocab_size": vocab}
    doc = make_report("serve", args.command_line, environment_info(torch.device("cpu")), endpoint,
                      workload_json, results)
    emit(doc, args.output_json)
    return 0 if results["num_completed"] else 1
