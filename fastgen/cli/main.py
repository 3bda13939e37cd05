"""The `fastgen` command: parses the subcommand and its flags, runs it, and turns user errors
into one-line messages with exit status 2.

Flag values are checked by argparse (exit 2, `argument --flag: ...`). Errors the engine finds
later, in input it was handed (a prompt longer than max_model_len, a KV budget too small for
one sequence), arrive as ValueError and print as `fastgen: error: ...`, also with status 2 and
no traceback: they are the user's to fix, not bugs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from fastgen.cli import bench_compare, bench_latency, bench_serve, bench_throughput, generate, serve
from fastgen.cli.help_format import HelpFormatter

EXIT_USAGE = 2  # argparse's status for bad usage; engine-detected input errors share it
EXIT_INTERRUPTED = 130

EPILOG = """\
examples:
  fastgen generate --chat "What is paged attention?"
  fastgen bench throughput --model-preset qwen3-0.6b --num-prompts 256 --input-len 512 --output-len 128
  fastgen bench latency --batch-size 1 --output-len 256 --output-json latency.json
  fastgen bench compare baseline.json new.json --fail-above 10
  fastgen serve --port 8000

Run `fastgen <command> --help` (or `fastgen bench <kind> --help`) for a command's flags."""


# Each command: its name, its line in the list of commands, and the module that describes it
# (DESCRIPTION, EPILOG), adds its flags (`add_arguments`) and runs it (`run`).
BENCH_COMMANDS = [
    ("throughput", "offline throughput of a random workload", bench_throughput),
    ("latency", "latency of one batch, end to end and per step", bench_latency),
    ("serve", "online benchmark of an OpenAI-compatible server", bench_serve),
    ("compare", "compare two bench reports (and gate on regressions)", bench_compare),
]
COMMANDS = [
    ("generate", "complete prompts and print the text", generate),
    ("serve", "serve a model over an OpenAI-compatible HTTP API", serve),
]


def build_parser() -> argparse.ArgumentParser:
    import fastgen

    parser = argparse.ArgumentParser(
        prog="fastgen",
        description="fastgen: a small, fast LLM inference engine (paged KV cache, prefix caching, "
        "continuous batching, CUDA graphs).",
        epilog=EPILOG, formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fastgen {fastgen.__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND", required=True)

    bench = commands.add_parser(
        "bench", help="benchmark the engine (throughput, latency) or a server (serve), and compare runs",
        description="Benchmark the engine on a random token-id workload.", formatter_class=HelpFormatter,
        epilog="examples:\n  fastgen bench throughput --model-preset qwen3-0.6b --num-prompts 256\n"
        "  fastgen bench latency --batch-size 1 --output-json latency.json\n"
        "  fastgen bench compare baseline.json new.json --fail-above 10",
    )
    kinds = bench.add_subparsers(title="benchmarks", dest="bench", metavar="KIND", required=True)
    for subparsers, table in ((kinds, BENCH_COMMANDS), (commands, COMMANDS)):
        for name, help_text, module in table:
            leaf = subparsers.add_parser(name, help=help_text, description=module.DESCRIPTION, epilog=module.EPILOG,
                                         formatter_class=HelpFormatter)
            module.add_arguments(leaf)
            leaf.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="warning",
                              help="verbosity of the engine's log messages (stderr)")
            leaf.set_defaults(run=module.run, parser=leaf)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); return the exit status.

    Bad flags raise SystemExit(2) from argparse; engine-detected input errors return 2.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = ["fastgen", *argv]
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"fastgen: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("fastgen: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`fastgen generate ... | head -1`): nothing left to say. Point
        # stdout at devnull so the interpreter's final flush does not fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:  # e.g. the report's folder became unwritable during the run
        print(f"fastgen: error: {exc}", file=sys.stderr)
        return 1
