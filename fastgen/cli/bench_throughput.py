"""`fastgen bench throughput`: offline throughput of a random workload, submitted all at once.

Like `vllm bench throughput` and nano-vllm's bench.py: every request arrives at t=0 and the
engine runs them with continuous batching as fast as it can. The clock covers submitting,
scheduling, the model, sampling and (with --detokenize) detokenization; per-request timings
(TTFT, TPOT, end-to-end) come from the engine's own request metrics, so TTFT includes the time a
request waited for a batch slot.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from fastgen.bench.workload import IntRange, WorkloadSpec, build_workload
from fastgen.cli import arg_types, engine_args
from fastgen.cli.bench_common import add_output_args, add_peer_args, announce_if_long, check_peer_args
from fastgen.cli.help_format import HelpFormatter

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


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "throughput", help="offline throughput of a random workload",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter,
    )
    add_workload_args(parser)
    run_group = parser.add_argument_group("run")
    run_group.add_argument("--no-warmup", dest="warmup", action="store_false",
                           help="skip the two short warm-up requests run before the clock starts")
    run_group.add_argument("--rounds", metavar="N", type=arg_types.positive_int, default=1,
                           help="run the workload N times, each time with fresh prompts (seed, seed + 1, ...), "
                           "fastgen then each --backend peer in every round; the report is the median round's "
                           "(by the ratio to the peer, else by output tokens/s), every round's rates listed")
    run_group.add_argument("--detokenize", action="store_true",
                           help="load the tokenizer and detokenize outputs as a server would "
                           "(default: token ids only)")
    add_output_args(parser)
    add_peer_args(parser, batch_size_flag=True)
    engine_args.add_engine_args(parser, max_model_len_default="--prefix-len + max --input-len + max --output-len",
                                dummy_weights=True)
    parser.set_defaults(run=run, parser=parser)
    return parser


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", metavar="N", type=arg_types.positive_int, default=1000, help="number of requests")
    group.add_argument("--input-len", type=arg_types.int_range(1), default=IntRange(1024, 1024), metavar="MIN[:MAX]",
                       help="prompt tokens after the shared prefix, drawn uniformly from [MIN, MAX]")
    group.add_argument("--output-len", type=arg_types.int_range(1), default=IntRange(128, 128),
                       metavar="MIN[:MAX]", help="tokens generated per request, drawn uniformly from [MIN, MAX]")
    group.add_argument("--prefix-len", metavar="N", type=arg_types.non_negative_int, default=0,
                       help="random tokens shared at the start of every prompt (prefix-cache hits)")
    group.add_argument("--temperature", metavar="T", type=arg_types.non_negative_float, default=0.0,
                       help="sampling temperature of every request; 0 is greedy")


def spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(args.num_prompts, args.input_len, args.output_len, args.prefix_len, args.seed)


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `fastgen --help` must not pay for torch.
    from fastgen.bench.environment import (
        engine_settings,
        environment_info,
        peak_memory_bytes,
        reset_peak_memory,
        synchronize,
    )
    from fastgen.bench.peers import TransformersPeer
    from fastgen.bench.report import emit, make_report
    from fastgen.bench.runner import warm_up
    from fastgen.bench.stats import median_index

    check_peer_args(args, args.parser)
    choice = engine_args.resolve_model(args, args.parser, need_tokenizer=args.detokenize)
    spec = spec_from_args(args)
    llm = engine_args.build_llm(
        choice, args, need_tokenizer=args.detokenize, needed_model_len=spec.max_seq_len,
        needed_by="--prefix-len + max --input-len + max --output-len",
    )
    engine, device = llm.engine, llm.engine.runner.device
    vocab = llm.config.model_config.vocab_size
    workloads = [build_workload(replace(spec, seed=spec.seed + r), vocab) for r in range(args.rounds)]
    if args.warmup:
        warm = warm_up(engine, llm.config.max_model_len)
        announce_if_long(args.rounds * warm.estimate_seconds(workloads[0], llm.config.max_num_seqs), device.type)
    peers = [TransformersPeer(llm.config.model, llm.config.torch_dtype) for _ in args.peers]
    synchronize(device)
    reset_peak_memory(device)
    rounds = []
    for r, workload in enumerate(workloads):
        desc = "bench" if args.rounds == 1 else f"bench {r + 1}/{args.rounds}"
        rounds.append(measure_round(engine, device, workload, args, peers, desc))
    # The round reported is the median one: by fastgen's ratio to the (first) peer where there is
    # one, so the ratio quoted is one real round's; else by fastgen's output tokens/s.
    reported = median_index([runs[0]["fastgen_speedup"] if runs else res["output_tokens_per_s"] for res, runs in rounds])
    results, peer_runs = rounds[reported]
    results["peak_memory_bytes"] = peak_memory_bytes(device)
    results["reported_round"] = reported
    results["rounds"] = [{"seed": spec.seed + r, "elapsed_s": res["elapsed_s"],
                          "output_tokens_per_s": res["output_tokens_per_s"],
                          "peers": [{"backend": p["backend"], "output_tokens_per_s": p["output_tokens_per_s"],
                                     "fastgen_speedup": p["fastgen_speedup"]} for p in runs]}
                         for r, (res, runs) in enumerate(rounds)]
    if peer_runs:
        results["peers"] = peer_runs
    workload_json = {**spec.to_json(), "seed": spec.seed + reported, "rounds": args.rounds,
                     "temperature": args.temperature, "warmup": args.warmup, "detokenize": args.detokenize}
    doc = make_report("throughput", args.command_line, environment_info(device), engine_settings(llm, choice),
                      workload_json, results)
    emit(doc, args.output_json)
    return 0


def measure_round(engine, device, workload, args: argparse.Namespace, peers: list, desc: str) -> tuple[dict, list]:
    """One round: the workload through fastgen (its results), then through each peer (each
    result with fastgen's output rate over the peer's, both from this round)."""
    from fastgen.bench.environment import synchronize
    from fastgen.bench.runner import EngineCounters, request_records, run_requests
    from fastgen.bench.stats import summarize_ms

    before = EngineCounters.read(engine)
    start = time.perf_counter()
    outputs = run_requests(engine, workload, args.temperature, progress=not args.quiet, desc=desc)
    synchronize(device)
    elapsed = time.perf_counter() - start
    counters = EngineCounters.read(engine).since(before)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    results = {
        "elapsed_s": elapsed,
        "num_requests": len(outputs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "ttft_ms": summarize_ms(o.metrics.time_to_first_token for o in outputs),
        "tpot_ms": summarize_ms(o.metrics.time_per_output_token for o in outputs),
        "e2e_latency_ms": summarize_ms(o.metrics.e2e_latency for o in outputs),
        "prefix_cache_hit_rate": counters.hit_rate,
        "cached_prompt_tokens": sum(o.metrics.num_cached_tokens for o in outputs),
        "num_preemptions": counters.preemptions,
    }
    if args.per_request:
        results["requests"] = request_records(outputs)
    peer_runs = []
    for peer in peers:
        result = peer.throughput(workload.prompts, workload.output_lens, args.hf_batch_size)
        peer_runs.append({**result, "fastgen_speedup": results["output_tokens_per_s"] / result["output_tokens_per_s"]})
    return results, peer_runs
