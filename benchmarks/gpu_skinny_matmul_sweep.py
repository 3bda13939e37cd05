"""Launch shapes of the Triton product for decode batches (`kernels/skinny_matmul.py`) on the
projections of Qwen3-0.6B (and its LM head), bf16, at 1-8 rows (--batches): each tiling's GPU
time per launch (40 launches captured in one CUDA graph, the weights cycled through copies
larger than the L2, so the host's launch cost is not counted), the default tiling's, the fastest,
the bandwidth each reaches on the weight bytes, and cuBLAS's (`F.linear`) beside them. One JSON:

    python3 benchmarks/gpu_skinny_matmul_sweep.py [--output FILE] [--batches 1,2,4,8]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.gpu_quantized_matmul_sweep import SHAPES, time_tilings, time_us, write_report  # noqa: E402
from fastgen.kernels.skinny_matmul import SkinnyTiling, default_skinny_tiling, skinny_matmul  # noqa: E402

TILINGS = [SkinnyTiling(n, k, 4) for n, k in itertools.product((2, 4, 8, 16, 32), (256, 512, 1024))] + [
    SkinnyTiling(n, k, 8) for n, k in ((8, 1024), (16, 1024), (16, 512), (32, 512))] + [
    SkinnyTiling(n, k, w) for n, k, w in ((1, 1024, 4), (1, 1024, 2), (2, 1024, 2), (1, 2048, 4), (2, 2048, 4),
                                          (2, 2048, 8), (4, 2048, 8))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "gpu-skinny-matmul-sweep.json"))
    p.add_argument("--batches", default="1,2,4,8")
    args = p.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(), "rows": []}
    for name, n, k in SHAPES:
        weight_bytes = n * k * 2
        copies = max(1, -(-256 * 2**20 // weight_bytes))  # one launch's weights are not in the L2 from the last
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device=device) for _ in range(copies)]
        for batch in (int(b) for b in args.batches.split(",")):
            x = torch.randn(batch, k, dtype=torch.bfloat16, device=device)
            want = F.linear(x.float(), weights[0].float())
            got = skinny_matmul(x, weights[0]).float()
            error = ((got - want).norm() / want.norm()).item()
            row = {"shape": name, "n": n, "k": k, "batch": batch, "weight_bytes": weight_bytes,
                   "relative_error": error, "default": str(default_skinny_tiling(k)),
                   "cublas_us": time_us(lambda i: F.linear(x, weights[i]), copies), "tilings": {}}
            row["default_us"] = time_us(lambda i: skinny_matmul(x, weights[i]), copies)
            time_tilings(row, TILINGS, lambda tiling, i: skinny_matmul(x, weights[i], tiling=tiling), copies)
            best = row["best"]
            for key in ("cublas", "default", "best"):
                row[f"{key}_gb_per_s"] = weight_bytes / row[f"{key}_us"] / 1e3
            print(f"{name} bs={batch}: cuBLAS {row['cublas_us']:.1f} us ({row['cublas_gb_per_s']:.0f} GB/s), "
                  f"default {row['default_us']:.1f} us ({row['default_gb_per_s']:.0f}), best {row['best_us']:.1f} "
                  f"us ({row['best_gb_per_s']:.0f}) {best}, error {error:.1e}", flush=True)
            report["rows"].append(row)
            write_report(args.output, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
