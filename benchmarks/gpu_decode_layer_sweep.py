"""A layer's decode step in one launch (`kernels/decode_layer.py`) against the six launches it
replaces, as the engine runs them (`normed_skinny_matmul`, `paged_decode_attention` preparing the
new token, `skinny_matmul`, the SwiGLU `normed_skinny_matmul`, `skinny_matmul`, all launched as
programmatic dependents on Hopper), at Qwen3-0.6B's layer in bf16, 1 and 2 rows, 512-token
contexts in block tables as wide as the engine's (`--table-reach`, gpu_decode.py's max_model_len:
the split grid is sized from it, so most split programs find nothing to do, as in the engine's
graphs). GPU time a layer: 40 layers in one CUDA graph, cycling through enough copies of the
layer's weights and cache that each launch reads them from memory, not the L2; the one launch
at its default tiling and at a few others, with the weights of the products after attention
asked into the L2 ahead or not, and the next copy's q|k|v too (`LayerTiling.l2_prefetch`), with
splits of 64 context tokens as well as 128 (`LayerTiling.min_tokens_per_split`), with programs
that take ticket after ticket, two an SM with their registers limited to fit or one an SM
without a limit (`LayerTiling.persistent_programs`); and a launch's
timeline, phase by phase (`LayerTrace`), at the default tiling with and without the L2 prefetch,
and with persistent programs. One JSON:

    python3 benchmarks/gpu_decode_layer_sweep.py [--output FILE] [--tilings 8/8/8,8/2/8] [--table-reach 4096]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.gpu_quantized_matmul_sweep import time_tilings, time_us, write_report  # noqa: E402
from fastgen.kernels.decode_layer import (  # noqa: E402
    DecodeLayerWeights,
    LayerCounters,
    LayerTiling,
    LayerTrace,
    decode_layer,
    decode_layer_in_six_launches,
    default_layer_tiling,
    persistent_register_limit,
)
from fastgen.layers.rotary import RotaryEmbedding  # noqa: E402

# Qwen3-0.6B: hidden, heads, KV heads, head dim, intermediate.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 1024, 16, 8, 128, 3072
BLOCK, CONTEXT = 256, 512
EPS = 1e-6
# bf16 outputs of one launch against the six launches: they may sum in another order.
MAX_RELATIVE_ERROR = 1e-2
# normed rows / plain rows / warps [/ products after attention asked into the L2 [/ least tokens
# a split takes [/ persistent programs, "2x": two an SM]]]. Persistent programs get their
# registers limited so that all fit at once (`persistent_register_limit`: 128 a thread for two
# 8-warp programs an SM, where Triton 3.6 takes about 150 unlimited): "1x" is the same loop
# without a limit.
DEFAULT_TILINGS = ("8/8/8,8/2/8,8/4/8,4/8/8,8/8/4,8/8/8/1,8/8/8/2,8/8/8/3,8/8/8/4,8/8/8/0/64,8/8/8/4/64,"
                   "8/8/8/0/128/2x,8/8/8/3/128/2x,8/8/8/4/64/2x,8/2/8/3/128/2x,8/8/8/3/128/1x")


def parse_tilings(text: str, sms: int) -> list[LayerTiling]:
    tilings = []
    for item in text.split(","):
        values = [int(v[:-1]) * sms if v.endswith("x") else int(v) for v in item.split("/")]
        tilings.append(LayerTiling(*values))
    return tilings


def register_limit(tiling: LayerTiling, sms: int) -> int | str:
    """The registers a thread a persistent tiling's launch is compiled with (0: no limit), or why
    it is refused (then `checked_tilings` records the fault too). The launch has at most as many
    programs as tickets; at this shape (about 1,400 tickets a row) that is every tiling's count."""
    try:
        return persistent_register_limit(tiling.persistent_programs, sms, tiling.num_warps)
    except ValueError as exc:
        return str(exc)


def layer_copy(device, rows: int, reach: int, gen: torch.Generator) -> dict:
    """One layer's weights and a cache holding each row's context but its newest token, in block
    tables `reach` tokens wide (-1 past the context)."""
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(device)

    n_qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    weights = DecodeLayerWeights(
        input_norm=1 + 0.1 * rand(HIDDEN), qkv=rand(n_qkv, HIDDEN, scale=HIDDEN**-0.5), qkv_bias=None,
        q_norm=1 + 0.1 * rand(HEAD_DIM), k_norm=1 + 0.1 * rand(HEAD_DIM),
        o=rand(HIDDEN, HEADS * HEAD_DIM, scale=(HEADS * HEAD_DIM) ** -0.5), post_norm=1 + 0.1 * rand(HIDDEN),
        gate_up=rand(2 * INTERMEDIATE, HIDDEN, scale=HIDDEN**-0.5), down=rand(HIDDEN, INTERMEDIATE,
                                                                           scale=INTERMEDIATE**-0.5),
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, eps=EPS, qk_eps=EPS)
    blocks_per_row = CONTEXT // BLOCK
    k_cache = rand(rows * blocks_per_row, BLOCK, KV_HEADS, HEAD_DIM)
    v_cache = rand(rows * blocks_per_row, BLOCK, KV_HEADS, HEAD_DIM)
    tables = torch.full((rows, -(-reach // BLOCK)), -1, dtype=torch.int32)
    tables[:, :blocks_per_row] = torch.arange(rows * blocks_per_row, dtype=torch.int32).view(rows, blocks_per_row)
    tables = tables.to(device)
    return {"weights": weights, "k_cache": k_cache, "v_cache": v_cache, "tables": tables,
            "counters": LayerCounters(device)}


def six_launches(layer, x, residual, step):
    return decode_layer_in_six_launches(x, residual, layer["weights"], step["positions"], step["cos_sin"],
                                        layer["k_cache"], layer["v_cache"], layer["tables"], step["lens"],
                                        step["slots"], HEAD_DIM**-0.5)


def one_launch(layer, x, residual, step, tiling=None, trace=None):
    return decode_layer(x, residual, layer["weights"], step["positions"], step["cos_sin"], layer["k_cache"],
                        layer["v_cache"], layer["tables"], step["lens"], step["slots"], HEAD_DIM**-0.5,
                        layer["counters"], tiling, trace)


def checked_tilings(row: dict, tilings, layer, x, residual, step, want) -> list[LayerTiling]:
    """The tilings whose one launch (on counters of its own) neither gave up a wait nor strays
    from the six launches; each other one's fault goes into row["tilings"] in place of a time,
    since timing it would take a quarter of a second a launch, or time wrong outputs."""
    kept = []
    for tiling in tilings:
        probe = dict(layer, counters=LayerCounters(want.device))
        try:
            got = one_launch(probe, x, residual, step, tiling)[0].float()
            probe["counters"].raise_if_stalled()
        except Exception as exc:  # noqa: BLE001 - a tiling that fails is a result too
            row["tilings"][str(tiling)] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        error = ((got - want).norm() / want.norm()).item()
        if not error <= MAX_RELATIVE_ERROR:
            row["tilings"][str(tiling)] = f"wrong: relative error {error:.1e} against the six launches"
            continue
        kept.append(tiling)
    return kept


def phase_timeline(layers, x, residual, step, tiling, launches: int = 9) -> dict:
    """Where a launch's time goes (`LayerTrace`), phase by phase: the median over launches, one
    at a time on layer copies the L2 does not hold (launched alone, a launch that asks for the
    next copy's q|k|v gains nothing from it here), of each phase's figures. The GPU's global
    clock may tick in steps of up to a microsecond: figures are that coarse."""
    summaries = []
    for i in range(launches):
        trace = LayerTrace()
        one_launch(layers[i % len(layers)], x, residual, step, tiling, trace)
        summaries.append(trace.summary())
    return {phase: {key: statistics.median(s[phase][key] for s in summaries) for key in figures}
            for phase, figures in summaries[0].items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "gpu-decode-layer-sweep.json"))
    p.add_argument("--tilings", default=DEFAULT_TILINGS,
                   help="normed rows/plain rows/warps[/L2 prefetch[/least tokens a split takes[/persistent programs, "
                        "Nx: N an SM]]], comma-separated")
    p.add_argument("--table-reach", type=int, default=4096, help="tokens a block table covers (>= the context)")
    args = p.parse_args()
    if args.table_reach < CONTEXT:
        p.error(f"--table-reach must be at least the context, {CONTEXT}; got {args.table_reach}")
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tilings = parse_tilings(args.tilings, sms)
    gen = torch.Generator().manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "shape": {"hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS,
              "head_dim": HEAD_DIM, "intermediate": INTERMEDIATE, "context": CONTEXT, "block_size": BLOCK,
              "table_reach": args.table_reach},
              "sms": sms, "default": str(default_layer_tiling(HIDDEN, sms)),
              "register_limits": {str(t): register_limit(t, sms) for t in tilings if t.persistent_programs},
              "rows": []}
    layer_bytes = 2 * HIDDEN * ((HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM + 3 * INTERMEDIATE)
    copies = max(1, -(-256 * 2**20 // layer_bytes))
    for rows in (1, 2):
        layers = [layer_copy(device, rows, args.table_reach, gen) for _ in range(copies)]
        for i, layer in enumerate(layers):  # launch i + 1 runs the next copy: its q|k|v is the one to prefetch
            layer["weights"] = replace(layer["weights"], next_qkv=layers[(i + 1) % copies]["weights"].qkv)
        # Each row's newest token at the end of its context, in its last block.
        step = {"lens": torch.full((rows,), CONTEXT, dtype=torch.int32, device=device),
                "positions": torch.full((rows,), CONTEXT - 1, dtype=torch.int64, device=device),
                "slots": torch.tensor([(r * (CONTEXT // BLOCK) + CONTEXT // BLOCK - 1) * BLOCK + BLOCK - 1
                                       for r in range(rows)], dtype=torch.int64, device=device),
                "cos_sin": RotaryEmbedding(HEAD_DIM, 4096, 1e6, None).cos_sin.to(device)}
        x = torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
        residual = torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
        want = six_launches(layers[0], x, residual, step)[0].float()
        got = one_launch(layers[0], x, residual, step)[0].float()
        layers[0]["counters"].raise_if_stalled()  # a wait that gave up: stop before timing a faulty kernel
        row = {"batch": rows, "layer_bytes": layer_bytes, "copies": copies,
               "relative_error": ((got - want).norm() / want.norm()).item(), "tilings": {}}
        row["six_launches_us"] = time_us(lambda i: six_launches(layers[i], x, residual, step), copies)
        row["one_launch_us"] = time_us(lambda i: one_launch(layers[i], x, residual, step), copies)
        time_tilings(row, checked_tilings(row, tilings, layers[0], x, residual, step, want),
                     lambda tiling, i: one_launch(layers[i], x, residual, step, tiling), copies)
        default = default_layer_tiling(HIDDEN, sms)
        row["phases"] = {f"l2_prefetch={n}": phase_timeline(layers, x, residual, step, replace(default, l2_prefetch=n))
                         for n in (0, 3, 4)}
        row["phases"]["l2_prefetch=3,persistent=2x"] = phase_timeline(
            layers, x, residual, step, replace(default, l2_prefetch=3, persistent_programs=2 * sms))
        for layer in layers:
            layer["counters"].raise_if_stalled()
        for key in ("six_launches", "one_launch"):  # the layer's weights at that rate (the cache adds 2 MB a row)
            row[f"{key}_weights_tb_per_s"] = layer_bytes / row[f"{key}_us"] / 1e6
        print(f"bs={rows}: six launches {row['six_launches_us']:.1f} us, one launch {row['one_launch_us']:.1f} us, "
              f"best {row.get('best_us', 0):.1f} us {row.get('best')}, error {row['relative_error']:.1e}", flush=True)
        report["rows"].append(row)
        write_report(args.output, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
