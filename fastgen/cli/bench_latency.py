"""`fastgen bench latency`: how long one batch takes, end to end and step by step.

Like `vllm bench latency`. This module is the command line; the measurement (warm-up and
measured iterations, each peer right after each iteration) is `fastgen.bench.latency`.
"""

from __future__ import annotations

import argparse

from fastgen.cli import arg_types, engine_args
from fastgen.cli.bench_common import add_output_args, add_peer_args, check_peer_args

DESCRIPTION = """\
Measure the latency of one batch: run the same-shaped batch of requests to completion several
times and report the per-iteration latency, TTFT and TPOT per request, and the duration of each
prefill and decode step (percentiles in ms)."""

EPILOG = """\
examples:
  # batch of 8, 32 prompt tokens, 128 generated tokens, 10 warm-up + 30 measured iterations
  fastgen bench latency

  # batch-1 decode of the default model beside transformers and llama.cpp (a GGUF of it)
  fastgen bench latency --batch-size 1 --input-len 32 --output-len 128 --num-iters 5 \
      --backend transformers --backend llama.cpp --gguf SmolLM2-135M-Instruct-bf16.gguf

  # single-sequence decode latency of Qwen3-0.6B shapes, as JSON
  fastgen bench latency --model-preset qwen3-0.6b --batch-size 1 --input-len 128 \\
      --output-len 256 --output-json latency.json"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--batch-size", metavar="N", type=arg_types.positive_int, default=8, help="requests in the batch")
    group.add_argument("--input-len", metavar="N", type=arg_types.positive_int, default=32, help="prompt tokens per request")
    group.add_argument("--output-len", metavar="N", type=arg_types.positive_int, default=128,
                       help="tokens generated per request")
    group.add_argument("--num-iters", metavar="N", type=arg_types.positive_int, default=30, help="measured iterations")
    group.add_argument("--num-iters-warmup", metavar="N", type=arg_types.non_negative_int, default=10,
                       help="unmeasured iterations first (0: only the two short warm-up requests)")
    group.add_argument("--temperature", metavar="T", type=arg_types.non_negative_float, default=0.0,
                       help="sampling temperature of every request; 0 is greedy")
    add_output_args(parser)
    add_peer_args(parser, batch_size_flag=False)
    engine_args.add_engine_args(parser, max_model_len_default="--input-len + --output-len", dummy_weights=True)
    # A benchmark measures the compiled steps: its warm-up waits for them (`compile_s` in the report).
    parser.set_defaults(compile_mode="blocking")


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `fastgen --help` must not pay for torch.
    from fastgen.bench.latency import LatencySpec, measure_latency
    from fastgen.bench.report import emit, engine_report

    check_peer_args(args, args.parser)
    choice = engine_args.resolve_model(args, args.parser, need_tokenizer=False)
    llm = engine_args.build_llm(
        choice, args, need_tokenizer=False, needed_model_len=args.input_len + args.output_len,
        needed_by="--input-len + --output-len",
    )
    spec = LatencySpec(args.batch_size, args.input_len, args.output_len, args.num_iters, args.num_iters_warmup,
                       args.seed, args.temperature)
    results = measure_latency(llm, spec, peers=args.peers, gguf=args.gguf, per_request=args.per_request,
                              progress=not args.quiet)
    emit(engine_report("latency", args.command_line, llm, choice, spec.to_json(), results), args.output_json)
    return 0
