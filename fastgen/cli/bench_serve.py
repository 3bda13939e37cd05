"""`fastgen bench serve`: an online benchmark against any OpenAI-compatible endpoint.

Like `vllm bench serve`. This module is the command line; the load (Poisson arrivals, a
concurrency limit, streamed or plain completions) and its results are `fastgen.bench.serve_load`.
"""

from __future__ import annotations

import argparse
import math
import sys

from fastgen.cli import arg_types
from fastgen.cli.bench_common import add_output_args, add_workload_args, workload_spec

DESCRIPTION = """\
Benchmark a running OpenAI-compatible server (fastgen's own, or another engine's): send streamed
(or, with --no-stream, plain) completions of random token-id prompts at a Poisson request rate or
a fixed concurrency, and report TTFT, TPOT, inter-token and end-to-end latency percentiles,
throughput and goodput."""

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's address")
    target.add_argument("--model", default=None, help="model name to request (default: the first /v1/models lists)")
    target.add_argument("--vocab-size", metavar="N", type=arg_types.positive_int, default=None,
                        help="vocabulary prompts are drawn from (default: what fastgen's /v1/models reports)")
    target.add_argument("--timeout", metavar="S", type=arg_types.positive_float, default=600.0,
                        help="seconds one request may take")
    group = add_workload_args(parser, num_prompts=64, input_len=128, output_len=64)
    group.add_argument("--request-rate", metavar="R", type=arg_types.rate, default=math.inf,
                       help="requests per second, Poisson arrivals (inf, the default: all at once)")
    group.add_argument("--max-concurrency", metavar="N", type=arg_types.positive_int, default=None,
                       help="most requests in flight (default: no limit)")
    group.add_argument("--seed", metavar="N", type=arg_types.non_negative_int, default=0,
                       help="seed of the prompts and of the arrival times")
    group.add_argument("--slo", metavar="ttft=MS,tpot=MS", type=slo_spec, default=None,
                       help="latency bounds in ms (ttft, tpot, e2e) for goodput")
    group.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                       help="streamed completions; --no-stream sends plain ones, timed to their whole answer "
                            "(no TTFT, TPOT or inter-token latency, and an --slo on those is refused)")
    add_output_args(parser)


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `fastgen --help` must not pay for httpx, numpy or torch.
    import httpx

    from fastgen.bench.report import emit, endpoint_report
    from fastgen.bench.serve_load import measure_serve, served_model
    from fastgen.bench.workload import build_workload

    if not args.stream and set(args.slo or {}) - {"e2e"}:
        args.parser.error(f"argument --slo: {sorted(set(args.slo) - {'e2e'})} are not measured by plain requests "
                          "(--no-stream): bound e2e only")
    base_url = args.base_url.rstrip("/")
    try:
        model, vocab = served_model(base_url, args.model, args.vocab_size)
    except httpx.HTTPError as exc:
        raise ValueError(f"--base-url {base_url}: cannot read /v1/models ({exc})") from None
    spec = workload_spec(args)
    workload = build_workload(spec, vocab)
    if not args.quiet:
        print(f"sending {args.num_prompts} requests to {base_url} ({model}) at "
              f"{args.request_rate} req/s", file=sys.stderr, flush=True)
    results = measure_serve(f"{base_url}/v1/completions", model, workload, request_rate=args.request_rate,
                            max_concurrency=args.max_concurrency, timeout_s=args.timeout,
                            temperature=args.temperature, seed=args.seed, slo=args.slo, stream=args.stream,
                            per_request=args.per_request)
    workload_json = {**spec.to_json(), "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
                     "max_concurrency": args.max_concurrency, "temperature": args.temperature, "stream": args.stream}
    endpoint = {"base_url": base_url, "model": model, "vocab_size": vocab}
    emit(endpoint_report(args.command_line, endpoint, workload_json, results), args.output_json)
    return 0 if results["num_completed"] else 1
