"""Launch settings of the paged decode attention kernel, swept on a GPU at Qwen3-0.6B shapes
(16 query heads, 8 KV heads, head_dim 128, bf16, 256-token blocks): each variant's median time
(CUDA graphs of 20 launches, so launch gaps stay out), its KV bytes over that time, and its
error against the torch twin. Prints a table and writes JSON:

    python3 benchmarks/gpu_decode_attention_sweep.py [--output FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

from kernels.attention_tile import paged_strides  # noqa: E402
from kernels.decode_split_policy import MAX_SPLITS, num_sms  # noqa: E402
from kernels.paged_attention_torch import paged_decode_attention_torch  # noqa: E402
from kernels.paged_decode_attention import _new_token_args  # noqa: E402
from kernels.paged_decode_kernels import decode_combine_kernel, decode_split_kernel  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 256


def launch(q, k, v, tables, lens, out, parts, splits, min_tokens, block_n, warps, stages):
    batch = q.shape[0]
    part_acc, part_max, part_sum = parts
    decode_split_kernel[(batch, KV_HEADS, splits)](
        q, k, v, tables, lens, out, part_acc, part_max, part_sum, HEAD_DIM ** -0.5,
        *paged_strides(q, k, v, out, tables), HEADS, splits, *_new_token_args(None, q), lens,
        BLOCK_SIZE=BLOCK, GROUP=HEADS // KV_HEADS, HEAD_DIM=HEAD_DIM, ONE_SPLIT=splits == 1, MIN_TOKENS=min_tokens,
        BLOCK_G=16, BLOCK_N=block_n, BLOCK_D=HEAD_DIM, DOT_DTYPE=triton.language.bfloat16, PDL=False,
        NEW_TOKEN=False, QK_NORM=False, COMBINE_IN_LAST_SPLIT=False, FIRST_N=0, EARLY_CACHE_READS=False,
        num_warps=warps, num_stages=stages)
    if splits > 1:
        decode_combine_kernel[(batch, HEADS)](
            part_acc, part_max, part_sum, lens, out, out.stride(0), out.stride(1), HEADS, splits,
            HEAD_DIM=HEAD_DIM, MIN_TOKENS=min_tokens, BLOCK_S=triton.next_power_of_2(MAX_SPLITS), BLOCK_D=HEAD_DIM,
            PDL=False, EARLY_CACHE_READS=False, num_warps=4)


def case(batch: int, context: int, max_context: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = triton.cdiv(max_context, BLOCK)
    num_blocks = batch * triton.cdiv(context, BLOCK) + 1
    k = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    perm = torch.randperm(num_blocks - 1, device="cuda", generator=g).to(torch.int32)
    tables = torch.full((batch, blocks_per_seq), -1, dtype=torch.int32, device="cuda")
    used = triton.cdiv(context, BLOCK)
    tables[:, :used] = perm[: batch * used].view(batch, used)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", generator=g, dtype=torch.bfloat16)
    return q, k, v, tables, lens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    sms = num_sms(torch.device("cuda"))
    # (batch, context): the throughput workload's big batches at mid contexts, and batch 1.
    points = [(1, 512), (1, 4096), (64, 1024), (256, 1024)]
    variants = list(itertools.product((128, 256), (32, 64, 128), (4, 8), (1, 2, 3, 4)))
    rows = []
    for batch, context in points:
        q, k, v, tables, lens = case(batch, context, 4096 + 256)
        ref = paged_decode_attention_torch(q.float(), k.float(), v.float(), tables, lens, HEAD_DIM ** -0.5)
        kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * 2
        for min_tokens, block_n, warps, stages in variants:
            splits = max(1, min(triton.cdiv(2 * sms, batch * KV_HEADS), triton.cdiv(tables.shape[1] * BLOCK, min_tokens),
                                MAX_SPLITS))
            parts = (torch.empty(batch, HEADS, splits, HEAD_DIM, device="cuda"),
                     torch.empty(batch, HEADS, splits, device="cuda"), torch.empty(batch, HEADS, splits, device="cuda"))
            out = torch.full_like(q, float("nan"))
            settings = (min_tokens, block_n, warps, stages)
            try:
                launch(q, k, v, tables, lens, out, parts, splits, *settings)
                torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(20):
                        launch(q, k, v, tables, lens, out, parts, splits, *settings)
                ms = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") / 20
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a row, not a stop
                rows.append(dict(batch=batch, context=context, settings=settings, error=str(exc)[:200]))
                continue
            rows.append(dict(batch=batch, context=context, settings=settings, splits=splits, us=ms * 1e3,
                             tb_per_s=kv_bytes / ms / 1e9, rel_err=err))
    current = (128, 64, 4, None)
    print("batch context  (min_tokens, block_n, warps, stages): us, TB/s, rel err   [current: 128, 64, 4, default]")
    for batch, context in points:
        mine = sorted((r for r in rows if r["batch"] == batch and r["context"] == context and "us" in r),
                      key=lambda r: r["us"])
        base = [r for r in mine if r["settings"][:3] == current[:3] and r["settings"][3] == 3]
        for r in mine[:5] + base:
            print(f"{batch:5d} {context:7d}  {r['settings']}: {r['us']:8.1f} {r['tb_per_s']:5.2f} {r['rel_err']:.1e}")
    if args.output:
        Path(args.output).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
