"""What the bench commands share on their command lines: the random workload's flags
(throughput and serve), the output flags (all three) and the side-by-side peers (throughput and
latency), checked before any model loads."""

from __future__ import annotations

import argparse

from fastgen.bench.workload import IntRange, WorkloadSpec
from fastgen.cli import arg_types


def add_workload_args(parser: argparse.ArgumentParser, num_prompts: int, input_len: int,
                      output_len: int) -> argparse._ArgumentGroup:
    """The flags of a `WorkloadSpec` but its seed, and the temperature; the group, for more."""
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", metavar="N", type=arg_types.positive_int, default=num_prompts,
                       help="number of requests")
    group.add_argument("--input-len", type=arg_types.int_range(1), default=IntRange(input_len, input_len),
                       metavar="MIN[:MAX]", help="prompt tokens after the shared prefix, drawn uniformly from [MIN, MAX]")
    group.add_argument("--output-len", type=arg_types.int_range(1), default=IntRange(output_len, output_len),
                       metavar="MIN[:MAX]", help="tokens generated per request, drawn uniformly from [MIN, MAX]")
    group.add_argument("--prefix-len", metavar="N", type=arg_types.non_negative_int, default=0,
                       help="random tokens shared at the start of every prompt (prefix-cache hits)")
    group.add_argument("--temperature", metavar="T", type=arg_types.non_negative_float, default=0.0,
                       help="sampling temperature of every request; 0 is greedy")
    return group


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(args.num_prompts, args.input_len, args.output_len, args.prefix_len, args.seed)


def add_output_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--output-json", metavar="PATH", default=None, type=arg_types.output_path,
                       help="also write the results as one JSON document (schema: docs/bench-json.md); "
                       "'-' prints it to stdout and the summary to stderr")
    group.add_argument("--per-request", action="store_true",
                       help="also record each request's lengths, TTFT, TPOT and end-to-end latency in the JSON")
    group.add_argument("--quiet", action="store_true", help="no progress reports on stderr")


def add_peer_args(parser: argparse.ArgumentParser, batch_size_flag: bool) -> None:
    """--backend PEER (repeatable) and what the peers need. batch_size_flag: add the transformers
    batch size (throughput runs a whole workload; latency runs its one batch)."""
    group = parser.add_argument_group("side by side")
    group.add_argument("--backend", dest="peers", action="append", default=[], choices=("transformers", "llama.cpp"),
                       help="also run the same workload through this library, in turn with fastgen (each "
                       "latency iteration, each throughput round), and record both with the ratio (repeatable). "
                       "transformers: generate() on the model folder's weights in the engine's dtype; llama.cpp: "
                       "--gguf through llama-cpp-python (batch 1)")
    group.add_argument("--gguf", metavar="PATH", default=None, help="the GGUF file the llama.cpp backend runs")
    if batch_size_flag:
        group.add_argument("--hf-batch-size", metavar="N", type=arg_types.positive_int, default=16,
                           help="requests per transformers generate() call (left-padded)")


def check_peer_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse (exit 2) a peer that cannot run, before any model loads."""
    from fastgen.bench.peers import llama_cpp_available

    if "llama.cpp" in args.peers:
        if args.gguf is None:
            parser.error("--backend llama.cpp needs --gguf PATH (a GGUF of the same model)")
        if not llama_cpp_available():
            parser.error("--backend llama.cpp needs the llama-cpp-python package, which is not importable")
        if getattr(args, "batch_size", None) != 1:
            parser.error("--backend llama.cpp runs one sequence: it is for `fastgen bench latency --batch-size 1`"
                         f" (got --batch-size={getattr(args, 'batch_size', None)})")
    if args.peers and (args.model_preset is not None or args.load_format == "dummy"):
        parser.error("--backend needs real weights: a --model folder, not --model-preset or --load-format dummy")
