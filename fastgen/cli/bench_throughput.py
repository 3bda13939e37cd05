"""`fastgen bench throughput`: offline throughput of a random workload, submitted all at once.

Like `vllm bench throughput` and nano-vllm's bench.py. This module is the command line; the
measurement (rounds, peers, the median round) is `fastgen.bench.throughput`.
"""

from __future__ import annotations

import argparse

from fastgen.cli import arg_types, bench_common, engine_args

DESCRIPTION = """\
Measure offline throughput: build a random token-id workload, submit every request at once and
run the engine until all finish. Reports requests/s, output and total tokens/s, TTFT, TPOT and
end-to-end latency percentiles, the prefix-cache hit rate, preemptions and peak memory."""

EPILOG = """\
examples:
  # the default model (SmolLM2-135M-Instruct), 200 requests of 128 + 128 tokens
  fastgen bench throughput --num-prompts 200 --input-len 128 --output-len 128

  # Qwen3-0.6B shapes on random weights, varied lengths, JSON report
  fastgen bench throughput --model-preset qwen3-0.6b --num-prompts 1000 \\
      --input-len 100:1024 --output-len 100:1024 --output-json qwen3.json

  # the same workload through transformers too (batches of 16), the ratio in the report
  fastgen bench throughput --num-prompts 32 --input-len 32:160 --output-len 64 --backend transformers

  # a shared 512-token prefix, prefix caching off for comparison
  fastgen bench throughput --model ./my-model --prefix-len 512 --no-enable-prefix-caching"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bench_common.add_workload_args(parser, num_prompts=1000, input_len=1024, output_len=128)
    run_group = parser.add_argument_group("run")
    run_group.add_argument("--no-warmup", dest="warmup", action="store_false",
                           help="skip the two short warm-up requests run before the clock starts (on CPU, graphs "
                           "not yet compiled or loaded are then built inside the measurement: see compile_s)")
    run_group.add_argument("--rounds", metavar="N", type=arg_types.positive_int, default=1,
                           help="run the workload N times, the same requests (lengths) each time with fresh "
                           "token ids (seed, seed + 1, ...), "
                           "fastgen then each --backend peer in every round; the report is the median round's "
                           "(by the ratio to the peer, else by output tokens/s), every round's rates listed")
    run_group.add_argument("--detokenize", action="store_true",
                           help="load the tokenizer and detokenize outputs as a server would "
                           "(default: token ids only)")
    bench_common.add_output_args(parser)
    bench_common.add_peer_args(parser, batch_size_flag=True)
    engine_args.add_engine_args(parser, max_model_len_default="--prefix-len + max --input-len + max --output-len",
                                dummy_weights=True)
    # A benchmark measures the compiled steps: its warm-up waits for them (`compile_s` in the report).
    parser.set_defaults(compile_mode="blocking")


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `fastgen --help` must not pay for torch.
    from fastgen.bench.report import emit, engine_report
    from fastgen.bench.throughput import measure_throughput

    bench_common.check_peer_args(args, args.parser)
    choice = engine_args.resolve_model(args, args.parser, need_tokenizer=args.detokenize)
    spec = bench_common.workload_spec(args)
    llm = engine_args.build_llm(
        choice, args, need_tokenizer=args.detokenize, needed_model_len=spec.max_seq_len,
        needed_by="--prefix-len + max --input-len + max --output-len",
    )
    results = measure_throughput(llm, spec, rounds=args.rounds, temperature=args.temperature, warmup=args.warmup,
                                 peers=args.peers, hf_batch_size=args.hf_batch_size,
                                 per_request=args.per_request, progress=not args.quiet)
    workload_json = {**spec.to_json(), "seed": spec.seed, "rounds": args.rounds,
                     "temperature": args.temperature, "warmup": args.warmup, "detokenize": args.detokenize}
    emit(engine_report("throughput", args.command_line, llm, choice, workload_json, results), args.output_json)
    return 0
