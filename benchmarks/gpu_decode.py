"""GPU benchmark, one command, on Qwen3-0.6B shapes with random (dummy) weights in bf16 (no
weights needed, no network):

    python3 benchmarks/gpu_decode.py [--output-dir DIR] [--sections a,b] [--quick] [--time-budget-s S]

Sections, each merged into DIR/gpu-decode-<device>.json as soon as it ends (a failure is
recorded in its section and the run goes on; sections of an earlier run that this one does not
run stay in the file, so two commands that run different sections build one report):
`bandwidth` (device-to-device copy), `graphs` (start-up: profile, warm-up/JIT and capture times
apart; decode steps at batch sizes that are and are not capture sizes, at short and 4K
contexts: wall time, CUDA-event time, one graph replay's GPU time, and the weight-streaming
floor beside bs=1), `logits` (on the graphs engine: graph replay against an eager forward of
the same step, bf16, batch 1, 3, 64 and 256 at long contexts), `kernels` (torch.profiler kernel
counts per decode step, graphs and eager, and GPU time by kernel: each kernel's own duration, and
how long it kept the step's timeline running past the kernels before it, which under programmatic
launch does not count a wait twice), `eager` (the same steps
without graphs, and where an eager step's host time goes), `throughput` (`fastgen bench
throughput`, 256 prompts, input and output uniform in 100..1024, nano-vllm's workload) and
`transformers` (that workload through transformers' generate on the same GPU, and its batch-1
decode latency) with the ratio of the two, and `quantization` (the graphs engine with int8 and int4
weights, Triton's weight-only matmul inside the graphs: decode steps at --quant-batch-sizes, the
weight-streaming floor, GPU time by kernel at batch 1, and the ratio to the bf16 `graphs` steps of
the same run), `speculative` (batch-1 decode with prompt lookup against without, verify steps in
their CUDA graphs: `gpu_speculative.py`'s two prompts, --spec-max-tokens tokens each). DIR
defaults to $FASTGEN_BENCH_DIR or
benchmarks/results. A section that would start after --time-budget-s seconds is skipped and
says so. Inductor's and Triton's caches go to .gpu-cache/ in the tree (ignored by git) unless
set, so a second command reuses the first's compiled kernels. It needs only torch, triton,
transformers, safetensors, numpy, tqdm and xxhash, run from the repository root (nothing
installed).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Before torch is imported: Inductor and Triton read these once.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".gpu-cache" / "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", str(ROOT / ".gpu-cache" / "triton"))

import torch  # noqa: E402

from benchmarks.gpu_measure import (  # noqa: E402
    copy_bandwidth,
    device_slug,
    driver_info,
    graph_vs_eager_logits,
    host_profile,
    kernel_times,
    kernels_per_step,
    streaming_floor_ms,
    time_decode_steps,
)
from benchmarks.gpu_speculative import measure_speculation  # noqa: E402
from fastgen import LLM  # noqa: E402
from fastgen.attention import triton_paged  # noqa: E402
from fastgen.bench.workload import WorkloadSpec, build_workload  # noqa: E402
from fastgen.cli.arg_types import int_range  # noqa: E402
import fastgen.kernels.programmatic_launch as launch_policy  # noqa: E402
from fastgen.layers import quantizable  # noqa: E402
from fastgen.models import one_launch_layer  # noqa: E402
from fastgen.models.presets import preset_config, preset_model_dir  # noqa: E402
from fastgen.worker import step_inputs  # noqa: E402

# `logits` and `kernels` are measured inside the graphs and eager sections, on their engines.
SECTIONS = ("bandwidth", "graphs", "logits", "kernels", "eager", "quantization", "throughput", "speculative",
            "transformers")
SCHEMA = "fastgen.bench.gpu-decode/3"


def build_llm(args, eager: bool, quantization: str | None = None) -> LLM:
    budget = (dict(gpu_memory_utilization=0.85) if args.device.startswith("cuda")  # CPU: smoke runs only
              else dict(num_kv_blocks=-(-args.max_model_len // args.block_size) * max(args.batch_sizes) + 8))
    return LLM(str(args.model_dir), load_format="dummy", skip_tokenizer_init=True, device=args.device,
               dtype=args.dtype, max_num_seqs=max(args.batch_sizes), max_model_len=args.max_model_len,
               block_size=args.block_size, enforce_eager=eager, compile_mode="blocking",
               quantization=quantization, **budget)


def startup_info(llm: LLM, seconds: float) -> dict:
    runner = llm.engine.runner
    info = {"seconds": seconds, "attention_backend": runner.backend.name, "num_kv_blocks": runner.num_kv_blocks,
            "kv_cache_bytes": runner.kv_cache.num_bytes, "device": llm.config.device}
    if runner.graphs is not None:
        info |= {"graph_batch_sizes": runner.graphs.sizes, "graph_warmup_s": runner.graphs.warmup_seconds,
                 "graph_capture_s": runner.graphs.capture_seconds,
                 "graph_memory_bytes": runner.graphs.graph_memory_bytes}
    return info


def decode_sweep(args, eager: bool, report: dict) -> dict:
    start = time.perf_counter()
    llm = build_llm(args, eager)
    section = {"startup": startup_info(llm, time.perf_counter() - start), "steps": []}
    bandwidth = report.get("bandwidth", {}).get("bytes_per_s")
    for batch, context in args.points:
        row = time_decode_steps(llm, batch, context, args.steps, args.device)
        # Steps whose one-launch layers' waits gave up computed wrong tokens: their times are void.
        one_launch_layer.raise_if_stalled(llm.engine.runner.model)
        if batch == 1:
            row["floor"] = streaming_floor_ms(llm, context, bandwidth)
        section["steps"].append(row)
        device_ms = row.get("device_step_ms", {}).get("median")
        exposed_ms = row.get("exposed_host_ms", {}).get("median")
        detail = f", device step {device_ms:.3f} ms, exposed host {exposed_ms:.4f} ms" if device_ms else ""
        print(f"{'eager' if eager else 'graphs'} bs={batch} ctx={context}: {row['wall_ms']['median']:.3f} ms{detail}",
              flush=True)
    mode = "eager" if eager else "graphs"
    if "kernels" in args.sections:
        kernels = report.setdefault("kernels", {})
        largest = max(args.batch_sizes)  # the engine's max_num_seqs: no larger batch decodes whole
        kernels[mode] = kernels_per_step(llm, min(8, largest), args.device)
        kernels[f"{mode}_time_bs1"] = kernel_times(llm, 1, args.context_len, args.device)
        if largest >= 64:
            kernels[f"{mode}_time_bs64"] = kernel_times(llm, 64, args.context_len, args.device)
    report.setdefault("host_profile", {})[f"{mode}_bs1"] = host_profile(llm, 1, args.context_len)
    if not eager and "logits" in args.sections:
        report["logits"] = logit_checks(llm, args)
    del llm
    _free()
    return section


def quantized_sweep(args, report: dict) -> dict:
    """int8 and int4 weights on the graphs engine: the steps at --quant-batch-sizes, each beside
    the bf16 graphs step of the same batch and context when this run measured it."""
    bandwidth = report.get("bandwidth", {}).get("bytes_per_s")
    bf16 = {(r["batch_size"], r["context_len"]): r["wall_ms"]["median"]
            for r in report.get("graphs", {}).get("steps", [])} if "graphs" in args.sections else {}
    section = {}
    for method in ("int8", "int4"):
        start = time.perf_counter()
        llm = build_llm(args, eager=False, quantization=method)
        rows = []
        for batch in args.quant_batch_sizes:
            row = time_decode_steps(llm, batch, args.context_len, args.steps, args.device)
            if batch == 1:
                row["floor"] = streaming_floor_ms(llm, args.context_len, bandwidth)
            if (bf16_ms := bf16.get((batch, args.context_len))) is not None:
                row["speedup_over_bf16"] = bf16_ms / row["wall_ms"]["median"]
            rows.append(row)
            print(f"{method} bs={batch} ctx={args.context_len}: {row['wall_ms']['median']:.3f} ms", flush=True)
        section[method] = {"startup": startup_info(llm, time.perf_counter() - start), "steps": rows,
                           "kernels_bs1": kernel_times(llm, 1, args.context_len, args.device)}
        del llm
        _free()
    return section


def logit_checks(llm: LLM, args) -> list[dict]:
    """Graph against eager logits at batch 1, 3, 64 and 256, each at --long-context or the
    longest context the KV budget holds for that batch."""
    runner = llm.engine.runner
    capacity = runner.num_kv_blocks * args.block_size
    rows = []
    for batch in (1, 3, 64, 256):
        if batch > max(args.batch_sizes):
            continue
        context = min(args.long_context, (capacity // batch - args.block_size - 16) // args.block_size * args.block_size)
        rows.append(graph_vs_eager_logits(llm, batch, context))
        print(f"logits bs={batch} ctx={context}: {rows[-1]}", flush=True)
    return rows


def fastgen_throughput(args) -> dict:
    """`fastgen bench throughput` as the CLI runs it, in a process of its own."""
    out = Path(args.output_dir) / ".throughput.json"
    cmd = [sys.executable, "-m", "fastgen", "bench", "throughput", "--load-format", "dummy",
           "--model-preset", args.preset, "--device", args.device, "--dtype", args.dtype, "--quiet",
           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--max-num-seqs", "256", "--output-json", str(out)]
    if not args.device.startswith("cuda"):
        cmd += ["--num-kv-blocks", "64", "--block-size", "16"]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    doc = json.loads(out.read_text())
    out.unlink()
    return doc["results"]


def hf_throughput(args, report: dict) -> dict:
    from benchmarks.hf_generate import transformers_throughput

    spec = WorkloadSpec(args.num_prompts, args.input_len, args.output_len)
    workload = build_workload(spec, preset_config(args.preset)["vocab_size"])
    return transformers_throughput(str(args.model_dir), workload, args.device, getattr(torch, args.dtype),
                                   args.hf_batch_size, latency_context=args.context_len, latency_tokens=args.steps * 4)


def add_ratios(report: dict) -> None:
    """Graphs over eager and fastgen over transformers, from sections of the same run only (a
    ratio across runs would compare two machines' states); None with the reason otherwise."""
    run_of = report.get("section_run", {})

    def same_run(a: str, b: str) -> bool:
        return a in run_of and run_of.get(a) == run_of.get(b)

    report["speedup_graphs_over_eager"] = None
    if same_run("graphs", "eager") and "steps" in report["graphs"] and "steps" in report["eager"]:
        graphed = {(r["batch_size"], r["context_len"]): r["wall_ms"]["median"] for r in report["graphs"]["steps"]}
        report["speedup_graphs_over_eager"] = {
            f"bs{r['batch_size']}-ctx{r['context_len']}": r["wall_ms"]["median"] / graphed[r["batch_size"], r["context_len"]]
            for r in report["eager"]["steps"] if (r["batch_size"], r["context_len"]) in graphed}
    report["fastgen_over_transformers"] = None
    ours = report.get("throughput", {}).get("output_tokens_per_s")
    theirs = report.get("transformers", {}).get("output_tokens_per_s")
    if same_run("throughput", "transformers") and ours and theirs:
        report["fastgen_over_transformers"] = ours / theirs


# What each section took on an H100 at the default settings (cold caches), rounded up: a section
# is started only when the time budget still holds this much, so the command ends in time.
# `speculative` took 17 s on an H200 with --spec-max-tokens 128 (warm Triton cache); twice the
# tokens by default, and room for a cold start.
EXPECTED_SECONDS = {"bandwidth": 5, "graphs": 60, "eager": 30, "quantization": 90, "speculative": 60,
                    "throughput": 60, "transformers": 240}


def run_section(name: str, fn, report: dict, path: Path, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left < EXPECTED_SECONDS[name]:
        report[name] = {"skipped": f"--time-budget-s: {max(left, 0):.0f}s left, the section takes about "
                                   f"{EXPECTED_SECONDS[name]}s"}
        print(f"section {name} skipped: {report[name]['skipped']}", flush=True)
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        return
    start = time.perf_counter()
    failed = False
    try:
        report[name] = fn()
    except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the others
        report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        print(f"section {name} failed: {exc}", file=sys.stderr, flush=True)
        failed = True
    if failed:  # after the except block, whose traceback still holds the section's engines
        _free()
    report.setdefault("section_seconds", {})[name] = time.perf_counter() - start
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"section {name} done in {report['section_seconds'][name]:.1f}s -> {path}", flush=True)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (the point); cpu only smoke-tests this script")
    p.add_argument("--preset", default="qwen3-0.6b", help="model shape preset (dummy weights)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", default="1,3,8,50,64,200,256",
                   help="decode batch sizes at --context-len (3, 50 and 200 are not capture sizes: padding cost)")
    p.add_argument("--context-len", type=int, default=512, help="tokens per sequence in the batch-size sweep")
    p.add_argument("--long-context", type=int, default=4096, help="context of the split-policy points")
    p.add_argument("--long-batch-sizes", default="1,3,8", help="batch sizes at --long-context")
    p.add_argument("--quant-batch-sizes", default="1,8,64", help="decode batch sizes of the quantization section")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per point")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int_range(1), default=int_range(1)("100:1024"))
    p.add_argument("--output-len", type=int_range(1), default=int_range(1)("100:1024"))
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--spec-max-tokens", type=int, default=256, help="tokens each prompt of `speculative` makes")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--quick", action="store_true", help="16 steps a point and a 64-prompt workload")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no section after this many seconds (each one that would is recorded as skipped)")
    p.add_argument("--output-dir", default=os.environ.get("FASTGEN_BENCH_DIR", str(ROOT / "benchmarks" / "results")))
    p.add_argument("--output", default=None, help="exact JSON path (overrides --output-dir's file name)")
    p.add_argument("--suffix", default="", help="added to --output-dir's file name (gpu-decode-<gpu><suffix>.json)")
    p.add_argument("--dense-products", choices=("skinny", "cublas"), default="skinny",
                   help="decode batches' bf16 products: fastgen's Triton kernel (the default) or cuBLAS")
    p.add_argument("--skinny-max-rows", type=int, choices=(1, 2, 4, 8), default=2,
                   help="the most rows a decode batch's bf16 products (and their fused norms) take in fastgen's "
                        "Triton kernels before cuBLAS (default 2)")
    p.add_argument("--skinny-block-k", type=int, choices=(1024, 4096), default=1024,
                   help="the widest K step of those products' default tiling (default 1024): 4096 has a "
                        "product's whole weight asked for before it waits for the kernel in front (the separate "
                        "kernels only; one-launch layers keep 1024)")
    p.add_argument("--fused-norms", choices=("on", "off"), default="on",
                   help="RMSNorm (and SwiGLU) inside the decode batches' products (the default), or apart")
    p.add_argument("--decode-new-token", choices=("on", "off"), default="on",
                   help="decode attention normalises, rotates and stores the new token itself (the default), "
                        "or a launch of its own does")
    p.add_argument("--programmatic-launch", choices=("on", "off"), default="on",
                   help="decode kernels launched as programmatic dependents on Hopper (the default), or not")
    p.add_argument("--combine-in-split", choices=("on", "off"), default="off",
                   help="decode attention combines its splits in the split kernel's last program, or in a "
                        "launch of its own (the default)")
    p.add_argument("--packed-uploads", choices=("on", "off"), default="on",
                   help="a step's inputs sent in one packed transfer (the default), or one copy a buffer")
    p.add_argument("--early-cache-reads", choices=("auto", "on", "off"), default="auto",
                   help="decode attention reads a split's first keys and values before it waits for q|k|v "
                        "(programmatic launch): in launches of at most EARLY_CACHE_READS_MAX_BATCH rows, a graph's "
                        "padded batch (auto, the default), at every batch, or at none")
    p.add_argument("--min-tokens-per-split", type=int, choices=(16, 32, 64, 128, 256), default=128,
                   help="fewest context tokens a split of decode attention takes (default 128): fewer make "
                        "more, shorter splits")
    p.add_argument("--one-launch-layers", choices=("on", "off"), default="off",
                   help="each layer's decode step of one or two rows in one launch, or in six (the default)")
    p.add_argument("--layer-l2-prefetch", type=int, choices=range(5), default=0,
                   help="with one-launch layers: how many of the products after attention (o_proj, gate|up, "
                        "down, the next layer's q|k|v) have their weights asked into the L2 as attention begins "
                        "(default 0)")
    p.add_argument("--layer-persistent-per-sm", type=int, choices=range(5), default=0,
                   help="with one-launch layers: programs an SM that take ticket after ticket (0, the default: a "
                        "program for each)")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.quant_batch_sizes = [int(b) for b in args.quant_batch_sizes.split(",") if b]
    long_sizes = [int(b) for b in args.long_batch_sizes.split(",") if b] if args.long_context else []
    args.points = [(b, args.context_len) for b in args.batch_sizes] + [(b, args.long_context) for b in long_sizes]
    args.sections = [s for s in args.sections.split(",") if s]
    if unknown := set(args.sections) - set(SECTIONS):
        p.error(f"unknown sections {sorted(unknown)}; known: {list(SECTIONS)}")
    if {"logits", "kernels"} & set(args.sections) and not {"graphs", "eager"} & set(args.sections):
        p.error("sections logits and kernels are measured on the graphs and eager engines: add graphs or eager")
    if args.quick:
        args.steps, args.num_prompts = 16, 64
    # At least 4096 on a GPU, so long contexts and the split policy are in play.
    args.max_model_len = max(4096 if args.device.startswith("cuda") else 0,
                             max(c for _, c in args.points) + 2 * args.steps + 64)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA GPU is available")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quantizable.SKINNY_MATMUL_ON_CUDA = args.dense_products == "skinny"
    quantizable.RMS_NORM_IN_PRODUCTS_ON_CUDA = args.fused_norms == "on"
    quantizable.SKINNY_MAX_ROWS_ON_CUDA = args.skinny_max_rows
    importlib.import_module("fastgen.kernels.skinny_matmul").SKINNY_MAX_BLOCK_K = args.skinny_block_k
    launch_policy.PROGRAMMATIC_LAUNCH_ON_CUDA = args.programmatic_launch == "on"
    triton_paged.DECODE_PREPARES_NEW_TOKEN = args.decode_new_token == "on"
    step_inputs.PACK_UPLOADS_ON_CUDA = args.packed_uploads == "on"
    importlib.import_module("fastgen.kernels.decode_split_policy").MIN_TOKENS_PER_SPLIT = args.min_tokens_per_split
    one_launch_layer.ONE_LAUNCH_LAYERS_ON_CUDA = args.one_launch_layers == "on"
    decode_layer = importlib.import_module("fastgen.kernels.decode_layer")
    decode_layer.L2_PREFETCH_PRODUCTS = args.layer_l2_prefetch
    decode_layer.PERSISTENT_PROGRAMS_PER_SM = args.layer_persistent_per_sm
    decode_attention = importlib.import_module("fastgen.kernels.paged_decode_attention")
    decode_attention.COMBINE_IN_LAST_SPLIT = args.combine_in_split == "on"
    decode_attention.EARLY_CACHE_READS = args.early_cache_reads != "off"
    if args.early_cache_reads == "on":
        decode_attention.EARLY_CACHE_READS_MAX_BATCH = None
    args.model_dir = preset_model_dir(args.preset)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    path = Path(args.output or Path(args.output_dir) / f"gpu-decode-{device_slug(gpu)}{args.suffix}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    args.output_dir = str(path.parent)
    earlier = json.loads(path.read_text()) if path.exists() else {}
    report = earlier if earlier.get("schema") == SCHEMA else {}
    # Sections this run measures again are replaced whole; the others keep their earlier run's.
    for name in args.sections:
        report.pop(name, None)
    report |= {
        "schema": SCHEMA, "timestamp": datetime.now(timezone.utc).isoformat(), "device": gpu,
        "git_revision": _git_revision(), "driver": driver_info(),
        "versions": {"torch": torch.__version__, "triton": _version("triton"), "transformers": _version("transformers"),
                     "python": sys.version.split()[0], "cuda": torch.version.cuda},
        "model": {"preset": args.preset, "dtype": args.dtype, "weights": "dummy"},
        "settings": {"steps": args.steps, "dense_products": args.dense_products, "fused_norms": args.fused_norms,
                     "skinny_max_rows": args.skinny_max_rows, "skinny_block_k": args.skinny_block_k,
                     "decode_new_token": args.decode_new_token,
                     "programmatic_launch": args.programmatic_launch, "packed_uploads": args.packed_uploads,
                     "combine_in_split": args.combine_in_split, "early_cache_reads": args.early_cache_reads,
                     "early_cache_reads_max_batch": decode_attention.EARLY_CACHE_READS_MAX_BATCH,
                     "min_tokens_per_split": args.min_tokens_per_split,
                     "one_launch_layers": args.one_launch_layers,
                     "layer_l2_prefetch": args.layer_l2_prefetch,
                     "layer_persistent_per_sm": args.layer_persistent_per_sm,
                     "block_size": args.block_size,
                     "max_model_len": args.max_model_len,
                     "points": args.points, "workload": {"num_prompts": args.num_prompts,
                                                         "input_len": str(args.input_len),
                                                         "output_len": str(args.output_len)}},
    }
    plan = {
        "bandwidth": lambda: {"bytes_per_s": copy_bandwidth(args.device)},
        "graphs": lambda: decode_sweep(args, eager=False, report=report),
        "eager": lambda: decode_sweep(args, eager=True, report=report),
        "quantization": lambda: quantized_sweep(args, report),
        "speculative": lambda: measure_speculation(args.preset, args.device, max_tokens=args.spec_max_tokens,
                                                   dtype=args.dtype),
        "throughput": lambda: fastgen_throughput(args),
        "transformers": lambda: hf_throughput(args, report),
    }
    deadline = time.monotonic() + (args.time_budget_s if args.time_budget_s is not None else float("inf"))
    runs = report.setdefault("runs", [])
    runs.append({"timestamp": report["timestamp"], "git_revision": report["git_revision"], "sections": args.sections,
                 "settings": report["settings"]})
    for name in SECTIONS:
        if name in args.sections and name in plan:
            report.setdefault("section_run", {})[name] = len(runs) - 1
            run_section(name, plan[name], report, path, deadline)
            add_ratios(report)
            path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return 0


def _git_revision() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() + ("+changes" if dirty else "") if done.returncode == 0 else None


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
