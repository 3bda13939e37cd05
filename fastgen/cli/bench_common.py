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
