"""Launch shapes of the Triton weight-only matmul (`kernels/quantized_matmul.py`) on the
projections of Qwen3-0.6B (and its LM head), int8 and int4, at decode batches (--batches, 1 and
64 by default): each tiling's GPU time per launch (40 launches captured in one CUDA graph, the
weights cycled through copies larger than the L2, so the host's launch cost is not counted), the
default tiling's, the fastest and the bandwidth it reaches on the weight bytes, with bf16's
`torch.nn.functional.linear` beside them. One JSON:

    python3 benchmarks/gpu_quantized_matmul_sweep.py [--output FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fastgen.kernels.quantized_matmul import Tiling, default_tiling, quantized_matmul  # noqa: E402
from fastgen.quantization.formats import QuantFormat  # noqa: E402
from fastgen.quantization.quantize import quantize_weight  # noqa: E402

# (name, N, K) of one Qwen3-0.6B layer's products, and the LM head.
SHAPES = [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072),
          ("lm_head", 151936, 1024)]
GEMV = [Tiling(n, k, 4, p, g) for n, k, p, g in itertools.product((8, 16), (512,), (None, 4 * 132), (True, False))]
DOT = [Tiling(n, k, 4, None, g) for n, k, g in itertools.product((32, 64), (64,), (True, False))]


def time_us(fn, copies: int, launches: int = 40) -> float:
    """GPU time of one launch: `launches` launches (cycling through the weight copies) captured in
    one CUDA graph, the median of 7 replays divided out (the host's launch cost is not in it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i % copies)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


def time_tilings(row: dict, tilings, launch, copies: int) -> dict[str, float]:
    """Each tiling's time into row["tilings"] (or the error that kept it from compiling: a result
    too) and the fastest into row["best"] / row["best_us"]; returns the timed ones."""
    for tiling in tilings:
        try:
            row["tilings"][str(tiling)] = time_us(lambda i: launch(tiling, i), copies)
        except Exception as exc:  # noqa: BLE001 - a tiling that does not compile is a result too
            row["tilings"][str(tiling)] = f"{type(exc).__name__}: {str(exc)[:200]}"
    timed = {key: us for key, us in row["tilings"].items() if isinstance(us, float)}
    if timed:
        best = min(timed, key=timed.get)
        row["best"], row["best_us"] = best, timed[best]
    return timed


def write_report(path: str, report: dict) -> None:
    """The report so far (written after each row, so a run cut short keeps its rows)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "gpu-quantized-matmul-sweep.json"))
    p.add_argument("--batches", default="1,64")
    args = p.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(), "rows": []}
    for (name, n, k), method in itertools.product(SHAPES, ("int8", "int4")):
        fmt = QuantFormat(8, k) if method == "int8" else QuantFormat(4, 32, has_mins=True)
        codes, scales, _ = quantize_weight(torch.randn(n, k), QuantFormat(fmt.bits, fmt.group_size))
        mins = -scales.float().mul(8).half() if fmt.has_mins else None
        # Enough copies that one launch's weights are not in the L2 from the last.
        copies = max(1, -(-256 * 2**20 // (codes.numel() + 2 * scales.numel())))
        weights = [(codes.to(device), scales.to(device), None if mins is None else mins.to(device))
                   for _ in range(copies)]
        dense = [torch.randn(n, k, dtype=torch.bfloat16, device=device) for _ in range(max(1, copies // 2))]
        weight_bytes = codes.numel() + scales.numel() * 2 * (2 if mins is not None else 1)
        for batch in (int(b) for b in args.batches.split(",")):
            x = torch.randn(batch, k, dtype=torch.bfloat16, device=device)
            row = {"shape": name, "n": n, "k": k, "method": method, "batch": batch, "weight_bytes": weight_bytes,
                   "bf16_linear_us": time_us(lambda i: F.linear(x, dense[i % len(dense)]), len(dense)),
                   "default": str(default_tiling(batch, fmt.bits)), "tilings": {}}
            # 4-bit steps are in bytes: half the inputs' block
            tilings = [Tiling(t.block_n, t.block_k if fmt.bits == 8 else t.block_k // 2, t.num_warps,
                              t.programs_wanted, t.group_scales) for t in (GEMV if batch <= 4 else DOT)]
            timed = time_tilings(row, tilings, lambda t, i: quantized_matmul(x, *weights[i], None, fmt.bits,
                                                                             fmt.group_size, tiling=t), copies)
            row["default_us"] = time_us(lambda i: quantized_matmul(x, *weights[i], None, fmt.bits, fmt.group_size),
                                        copies)
            if timed:
                row["best_gb_per_s"] = weight_bytes / row["best_us"] / 1e3
            print(f"{name} {method} bs={batch}: bf16 {row['bf16_linear_us']:.1f} us, "
                  f"default {row['default_us']:.1f} us, best {row.get('best_us', float('nan')):.1f} us "
                  f"{row.get('best')}", flush=True)
            report["rows"].append(row)
            write_report(args.output, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
