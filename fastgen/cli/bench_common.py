"""What both bench commands share on their command lines: the output flags."""

from __future__ import annotations

import argparse
import sys

from fastgen.cli import arg_types


def add_output_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--output-json", metavar="PATH", default=None, type=arg_types.output_path,
                       help="also write the results as one JSON document (schema: docs/bench-json.md); "
                       "'-' prints it to stdout and the summary to stderr")
    group.add_argument("--per-request", action="store_true",
                       help="also record each request's lengths, TTFT, TPOT and end-to-end latency in the JSON")
    group.add_argument("--quiet", action="store_true", help="no progress reports on stderr")


# A workload estimated to run longer than this (from the warm-up) is announced before it starts.
LONG_RUN_NOTICE_S = 600.0


def announce_if_long(estimate_s: float, device_type: str) -> None:
    """Say so before starting a run that will plainly take long (a CPU with the default workload)."""
    if estimate_s > LONG_RUN_NOTICE_S:
        print(f"fastgen: note: this workload will take at least ~{estimate_s / 60:.0f} minutes on {device_type} "
              f"(estimated from the warm-up); --num-prompts, --input-len and --output-len make it smaller",
              file=sys.stderr, flush=True)


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
