"""Start-up times a user feels, each the median of several fresh processes:

- `fastgen --help`: from process start to exit;
- `fastgen generate --stream` on the default model: from process start to the first byte of
  streamed text on stdout;
- `LLM()` on the default model: the constructor alone, with torch and fastgen already imported
  (so that checkouts that import torch lazily and eagerly are timed alike).

Usage: python benchmarks/startup_times.py [--root CHECKOUT] [--runs N] [--json PATH]
Runs `python -m fastgen` with CHECKOUT (default: this one) as the working directory, so two
checkouts can be compared with the same command and the same interpreter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_LLM_TIMER = """
import time
import torch
from fastgen import LLM
import fastgen.llm  # the imports themselves are not what we time
start = time.perf_counter()
LLM()
print(time.perf_counter() - start)
"""


def time_help(root: Path) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fastgen", "--help"], cwd=root, check=True, capture_output=True)
    return time.perf_counter() - start


def time_first_streamed_token(root: Path) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "fastgen", "generate", "--chat", "--stream", "--max-tokens", "8",
                             "Say hello."], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    first = proc.stdout.read(1)
    elapsed = time.perf_counter() - start
    proc.communicate()
    if not first or proc.returncode != 0:
        raise RuntimeError(f"fastgen generate failed in {root} (exit {proc.returncode})")
    return elapsed


def time_llm_constructor(root: Path) -> float:
    out = subprocess.run([sys.executable, "-c", _LLM_TIMER], cwd=root, check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout to measure (default: this one)")
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per measurement")
    parser.add_argument("--json", type=Path, default=None, help="also write the medians here")
    args = parser.parse_args()
    results = {}
    for name, measure in (("help_s", time_help), ("first_streamed_token_s", time_first_streamed_token),
                          ("llm_constructor_s", time_llm_constructor)):
        measure(args.root)  # one unmeasured run: the OS file cache, first-use conversion
        samples = [measure(args.root) for _ in range(args.runs)]
        results[name] = {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
                         "runs": len(samples)}
        print(f"{name:24s} median {results[name]['median']:.3f} s  (min {min(samples):.3f}, "
              f"max {max(samples):.3f}, {len(samples)} runs)")
    if args.json:
        args.json.write_text(json.dumps({"root": str(args.root.resolve().name), **results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
