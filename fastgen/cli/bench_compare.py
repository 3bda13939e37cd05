"""`fastgen bench compare OLD.json NEW.json`: what changed between two bench runs, and a CI gate."""

from __future__ import annotations

import argparse
import sys

from fastgen.cli import arg_types

EXIT_REGRESSION = 1

DESCRIPTION = """\
Compare two reports written by `fastgen bench throughput|latency --output-json`: print each
headline metric (throughput, TTFT/TPOT/end-to-end percentiles, step times) with its change, in
percent, signed so that + is better. With --fail-above PCT, exit 1 when any metric got worse by
more than PCT percent, so CI can gate on end-to-end performance."""

EPILOG = """\
examples:
  fastgen bench throughput --num-prompts 64 --input-len 128 --output-len 64 --output-json new.json
  fastgen bench compare baseline.json new.json --fail-above 10"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("old", metavar="OLD.json", help="the baseline report")
    parser.add_argument("new", metavar="NEW.json", help="the report to judge")
    parser.add_argument("--fail-above", metavar="PCT", type=arg_types.non_negative_float, default=None,
                        help="exit 1 when a metric is worse than the baseline by more than PCT percent")


def run(args: argparse.Namespace) -> int:
    from fastgen.bench.compare import compare_reports, format_comparison, load_report, setup_differences

    old, new = load_report(args.old), load_report(args.new)
    deltas = compare_reports(old, new)
    for note in setup_differences(old, new):
        print(f"note: the runs differ in {note}", file=sys.stderr)
    print(format_comparison(deltas, args.fail_above))
    worse = [d for d in deltas if d.worse_than(args.fail_above)]
    if worse:
        names = ", ".join(f"{d.metric} (missing from the new run)" if d.missing else
                          f"{d.metric} ({d.worse_pct:+.1f}% worse)" for d in worse)
        print(f"fastgen: regression beyond {args.fail_above:g}%: {names}", file=sys.stderr)
        return EXIT_REGRESSION
    return 0
