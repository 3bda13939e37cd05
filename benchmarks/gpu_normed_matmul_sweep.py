"""The norm taken into the decode batch's product (`kernels/normed_skinny_matmul.py`) against
the launches it replaces, at Qwen3-0.6B's widths in bf16, 1 and 2 rows: add+RMSNorm (compiled,
as the engine runs it), then the product (`skinny_matmul`), then SwiGLU (compiled) for gate|up.
Each variant's GPU time per layer-worth of launches (40 in one CUDA graph, weights cycled past
the L2), with programmatic launch on and off, and each tiling of the fused kernel (launched
with it). One JSON:

    python3 benchmarks/gpu_normed_matmul_sweep.py [--output FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.gpu_quantized_matmul_sweep import time_tilings, time_us, write_report  # noqa: E402
from fastgen.compile import build_op_set  # noqa: E402
import fastgen.kernels.programmatic_launch as launch_policy  # noqa: E402
from fastgen.kernels.normed_skinny_matmul import NormedTiling, default_normed_tiling, normed_skinny_matmul  # noqa: E402
from fastgen.kernels.skinny_matmul import skinny_matmul  # noqa: E402

SHAPES = [("qkv", 4096, 1024, False), ("gate_up", 6144, 1024, True)]
TILINGS = [NormedTiling(n, w) for n in (2, 4, 8) for w in (4, 8)]
EPS = 1e-6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "gpu-normed-matmul-sweep.json"))
    args = p.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    ops = build_op_set(compiled=True)
    report = {"device": torch.cuda.get_device_name(), "rows": []}
    for name, n, k, swiglu in SHAPES:
        weight_bytes = n * k * 2
        copies = max(1, -(-256 * 2**20 // weight_bytes))
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5 for _ in range(copies)]
        norm = torch.rand(k, dtype=torch.bfloat16, device=device) + 0.5
        for batch in (1, 2):
            x, res = (torch.randn(batch, k, dtype=torch.bfloat16, device=device) for _ in range(2))

            def unfused(i):
                normed, new_residual = ops.add_rms_norm(x, res, norm, EPS)
                y = skinny_matmul(normed, weights[i])
                return (ops.silu_and_mul(y) if swiglu else y), new_residual

            def fused(i, tiling=None):
                return normed_skinny_matmul(x, res, norm, EPS, weights[i], swiglu=swiglu, tiling=tiling)

            want, got = unfused(0)[0].float(), fused(0)[0].float()
            row = {"shape": name, "n": n, "k": k, "batch": batch, "swiglu": swiglu, "weight_bytes": weight_bytes,
                   "relative_error": ((got - want).norm() / want.norm()).item(),
                   "default": str(default_normed_tiling(k)), "tilings": {}}
            for pdl in (False, True):
                launch_policy.PROGRAMMATIC_LAUNCH_ON_CUDA = pdl
                suffix = "_pdl" if pdl else ""
                row[f"unfused_us{suffix}"] = time_us(unfused, copies)
                row[f"fused_us{suffix}"] = time_us(fused, copies)
            launch_policy.PROGRAMMATIC_LAUNCH_ON_CUDA = True  # the tilings as the engine launches them
            time_tilings(row, TILINGS, lambda tiling, i: fused(i, tiling), copies)
            print(f"{name} bs={batch}: unfused {row['unfused_us']:.1f} / {row['unfused_us_pdl']:.1f} us (pdl), "
                  f"fused {row['fused_us']:.1f} / {row['fused_us_pdl']:.1f}, best {row.get('best_us', 0):.1f} "
                  f"{row.get('best')}, error {row['relative_error']:.1e}", flush=True)
            report["rows"].append(row)
            write_report(args.output, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
