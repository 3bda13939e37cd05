"""What launches alone cost a decode step: a chain of dependent kernels, each reading one value
per program that the kernel before it wrote, captured in one CUDA graph and replayed, with and
without programmatic dependent launch (`kernels/programmatic_launch.py`).

A batch-1 decode step of Qwen3-0.6B is six such dependent launches a layer (28 layers) and a
few around them, about 173. Their cost at zero bytes, times their number, is the part of the step
that tuning a kernel's bytes cannot win back; only fewer launches can. The script prints a
table and writes `gpu-launch-floor-<gpu>.json`.

    python benchmarks/gpu_launch_floor.py --output-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastgen.kernels.programmatic_launch import (  # noqa: E402
    GRID_DEPENDENCY_CONTROL,
    gdc_launch_dependents,
    gdc_wait,
    launch_options,
)


@triton.jit
def _hop_kernel(src_ptr, dst_ptr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    tl.store(dst_ptr + pid, tl.load(src_ptr + pid) + 1.0)


def chain_us_per_launch(programs: int, launches: int, pdl: bool, replays: int, back_to_back: int = 10) -> float:
    """Median GPU time of one replay of `launches` dependent kernels, per launch (`back_to_back`
    replays between two events, so the graph's own launch hides behind the one before)."""
    buffers = [torch.zeros(programs, device="cuda", dtype=torch.float32) for _ in range(2)]

    def chain():
        for i in range(launches):
            _hop_kernel[(programs,)](buffers[i % 2], buffers[(i + 1) % 2], PDL=pdl, **launch_options(pdl))

    def check(what: str):  # every launch ran, in order, each after the one before had written
        torch.cuda.synchronize()
        if not torch.equal(buffers[launches % 2], torch.full_like(buffers[0], float(launches))):
            raise RuntimeError(f"{what}: the chain of {launches} launches did not count to {launches}")

    chain()  # compiles outside the capture
    check("eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for buffer in buffers:
        buffer.zero_()
    graph.replay()
    check("graph replay")
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(back_to_back):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / (launches * back_to_back))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--programs", default="1,132,528", help="programs a launch (comma-separated)")
    p.add_argument("--launches", type=int, default=173, help="dependent launches in one graph")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--output-dir", default=os.environ.get("FASTGEN_BENCH_DIR", str(ROOT / "benchmarks" / "results")))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    rows = []
    for programs in [int(n) for n in args.programs.split(",")]:
        for pdl in (False, True):
            if pdl and not (hopper and GRID_DEPENDENCY_CONTROL):
                continue
            us = chain_us_per_launch(programs, args.launches, pdl, args.replays)
            rows.append({"programs": programs, "programmatic_launch": pdl, "us_per_launch": us,
                         "ms_per_chain": us * args.launches / 1000.0})
    name = torch.cuda.get_device_name()
    result = {"schema": "fastgen.bench.gpu-launch-floor/1", "device": name, "launches": args.launches,
              "replays": args.replays, "torch": torch.__version__, "triton": triton.__version__, "rows": rows}
    out = Path(args.output_dir) / f"gpu-launch-floor-{re.sub('[^a-z0-9]+', '-', name.lower()).strip('-')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'programs':>9} {'PDL':>4} {'us/launch':>10} {f'ms/{args.launches}':>9}")
    for row in rows:
        print(f"{row['programs']:>9} {('on' if row['programmatic_launch'] else 'off'):>4} "
              f"{row['us_per_launch']:>10.2f} {row['ms_per_chain']:>9.3f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
