"""`fastgen bench latency`: how long one batch takes, end to end and step by step.

Like `vllm bench latency`: a batch of `--batch-size` requests of fixed input and output length
runs to completion, `--num-iters-warmup` times unmeasured and then `--num-iters` times measured.
Each iteration draws fresh random prompts, so its prefill is computed rather than served from
the prefix cache filled by the previous iteration. Every `engine.step()` is timed on its own
(synchronizing the GPU) and classified as prefill or decode from the scheduler's decision.
"""

from __future__ import annotations

import argparse
import sys

from fastgen.bench.workload import IntRange, WorkloadSpec, build_workload
from fastgen.cli import arg_types, engine_args
from fastgen.cli.bench_common import add_output_args, add_peer_args, announce_if_long, check_peer_args
from fastgen.cli.help_format import HelpFormatter

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


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "latency", help="latency of one batch, end to end and per step",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter,
    )
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
    parser.set_defaults(run=run, parser=parser)
    return parser


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `fastgen --help` must not pay for torch.
    from fastgen.bench.environment import (
        engine_settings,
        environment_info,
        peak_memory_bytes,
        reset_peak_memory,
    )
    from fastgen.bench.report import emit, make_report
    from fastgen.bench.runner import EngineCounters, IterationTimes, request_records, run_iteration, warm_up
    from fastgen.bench.stats import summarize_ms

    check_peer_args(args, args.parser)
    choice = engine_args.resolve_model(args, args.parser, need_tokenizer=False)
    llm = engine_args.build_llm(
        choice, args, need_tokenizer=False, needed_model_len=args.input_len + args.output_len,
        needed_by="--input-len + --output-len",
    )
    engine, device = llm.engine, llm.engine.runner.device
    vocab = llm.config.model_config.vocab_size

    def batch(iteration: int):
        spec = WorkloadSpec(args.batch_size, IntRange(args.input_len, args.input_len),
                            IntRange(args.output_len, args.output_len), seed=args.seed + iteration)
        return build_workload(spec, vocab)

    measured: list[IterationTimes] = []
    warm = warm_up(engine, llm.config.max_model_len)
    iterations = args.num_iters_warmup + args.num_iters
    announce_if_long(iterations * warm.estimate_seconds(batch(0), llm.config.max_num_seqs), device.type)
    for i in range(args.num_iters_warmup):
        run_iteration(engine, batch(i), args.temperature, device)
    peers = load_peers(args, llm)
    for peer in peers:
        peer.warm_up(batch(0).prompts)
    peer_runs: list[list[tuple[float, float]]] = [[] for _ in peers]
    reset_peak_memory(device)
    before = EngineCounters.read(engine)
    for i in range(args.num_iters_warmup, args.num_iters_warmup + args.num_iters):
        measured.append(run_iteration(engine, batch(i), args.temperature, device))
        # Each peer runs the same batch right after: a slow stretch of a shared machine then
        # slows both sides of an iteration's ratio, not one side of the whole comparison.
        for peer, runs in zip(peers, peer_runs):
            runs.append(peer.decode_once(batch(i).prompts, args.output_len))
        if not args.quiet:
            print(f"iteration {len(measured)}/{args.num_iters}: {measured[-1].total * 1000:.1f} ms",
                  file=sys.stderr, flush=True)
    counters = EngineCounters.read(engine).since(before)

    total_seconds = sum(t.total for t in measured)
    output_tokens = sum(t.output_tokens for t in measured)
    results = {
        "iteration_latency_ms": summarize_ms(t.total for t in measured),
        "iteration_latencies_ms": [t.total * 1000.0 for t in measured],
        "ttft_ms": summarize_ms(o.metrics.time_to_first_token for t in measured for o in t.outputs),
        "tpot_ms": summarize_ms(o.metrics.time_per_output_token for t in measured for o in t.outputs),
        "prefill_step_ms": summarize_ms(x for t in measured for x in t.prefill_steps),
        "decode_step_ms": summarize_ms(x for t in measured for x in t.decode_steps),
        "num_prefill_steps": sum(len(t.prefill_steps) for t in measured),
        "num_decode_steps": sum(len(t.decode_steps) for t in measured),
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / total_seconds,
        # One decode step advances every sequence of the batch by a token.
        "decode_tokens_per_s": _decode_rate(args.batch_size, measured),
        "num_preemptions": counters.preemptions,
        "peak_memory_bytes": peak_memory_bytes(device),
    }
    if args.per_request:
        results["requests"] = [{"iteration": i, **record} for i, t in enumerate(measured)
                               for record in request_records(t.outputs)]
    if peers:
        results["peers"] = peer_results(args, peers, peer_runs, measured)
    workload_json = {"batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
                     "num_iters": args.num_iters, "num_iters_warmup": args.num_iters_warmup, "seed": args.seed,
                     "temperature": args.temperature}
    doc = make_report("latency", args.command_line, environment_info(device), engine_settings(llm, choice),
                      workload_json, results)
    emit(doc, args.output_json)
    return 0


def _decode_rate(batch_size: int, measured) -> float | None:
    steps = sorted(x for t in measured for x in t.decode_steps)
    return batch_size / steps[len(steps) // 2] if steps else None


def load_peers(args: argparse.Namespace, llm) -> list:
    from fastgen.bench.peers import LlamaCppPeer, TransformersPeer

    return [TransformersPeer(llm.config.model, llm.config.torch_dtype) if name == "transformers"
            else LlamaCppPeer(args.gguf, args.input_len + args.output_len) for name in args.peers]


def peer_results(args: argparse.Namespace, peers: list, peer_runs: list, measured: list) -> list[dict]:
    """Each peer's decode tokens/s and prefill ms (medians over its runs of the measured
    iterations' batches), and fastgen's speedup: the median over iterations of fastgen's decode
    rate in that iteration over the peer's on the same batch right after, each side's rate its
    decode steps over their total time (the mean step, as the peer's run gives it)."""
    from fastgen.bench.peers import decode_summary
    from fastgen.bench.stats import median

    results = []
    for peer, runs in zip(peers, peer_runs):
        ratios = []
        for times, (_, peer_decode_s) in zip(measured, runs):
            if times.decode_steps:
                ratios.append((len(times.decode_steps) / sum(times.decode_steps)) /
                              ((args.output_len - 1) / peer_decode_s))
        results.append({**decode_summary(peer, runs, args.batch_size, args.output_len),
                        "fastgen_speedup": median(ratios) if ratios else None,
                        "fastgen_speedup_per_iteration": ratios})
    return results
