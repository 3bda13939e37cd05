"""GPU benchmark, one command: decode-step latency with CUDA graphs and eager at several batch
sizes, graph capture time and memory, and the throughput workload — on Qwen3-0.6B shapes with
random (dummy) weights in bf16, so no weights are needed.

    python3 benchmarks/gpu_decode.py                 # writes benchmarks/results/gpu-decode-<gpu>.json
    python3 benchmarks/gpu_decode.py --quick         # fewer steps, smaller throughput workload

It needs only torch, triton, transformers, safetensors and xxhash (run from the repo root; the
package need not be installed). The decode latency is the whole `LLMEngine.step()` — scheduling,
input preparation, the forward (graph replay or eager) and sampling — with the GPU synchronised
after each step, at a context of --context-len tokens per sequence.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fastgen import LLM, SamplingParams  # noqa: E402
from fastgen.models.presets import preset_model_dir  # noqa: E402



def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_llm(model_dir: Path, eager: bool, args) -> LLM:
    budget = dict(gpu_memory_utilization=0.45) if args.device.startswith("cuda") else dict(num_kv_blocks=4096 // args.block_size * max(args.batch_sizes) // 4 + 64)
    return LLM(
        str(model_dir), load_format="dummy", skip_tokenizer_init=True, device=args.device,
        dtype="bfloat16", max_num_seqs=max(args.batch_sizes), max_model_len=args.context_len + args.steps + 64,
        block_size=args.block_size, enforce_eager=eager, **budget,
    )


def decode_step_ms(llm: LLM, batch: int, args) -> dict:
    """Median/p10/p90 of engine.step() for `batch` sequences that are all decoding."""
    engine = llm.engine
    rng = random.Random(batch)
    vocab = engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 32, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(100, vocab - 100) for _ in range(args.context_len)], params)
           for _ in range(batch)]
    # Prefill (possibly several chunked steps), then a few decode steps to settle.
    while len(engine.scheduler.waiting) or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(args.steps):
        sync(args.device)
        start = time.perf_counter()
        engine.step()
        sync(args.device)
        times.append((time.perf_counter() - start) * 1e3)
    for request_id in ids:
        engine.abort(request_id)
    times.sort()
    return {
        "batch_size": batch,
        "median_ms": statistics.median(times),
        "p10_ms": times[len(times) // 10],
        "p90_ms": times[(len(times) * 9) // 10],
        "steps": len(times),
    }


def graph_info(llm: LLM) -> dict | None:
    graphs = llm.engine.runner.graphs
    if graphs is None:
        return None
    return {"batch_sizes": graphs.sizes, "capture_seconds": graphs.capture_seconds,
            "graph_memory_bytes": graphs.graph_memory_bytes}


def throughput(args, eager: bool) -> dict:
    """The `fastgen bench throughput` workload, run as the CLI runs it."""
    out = ROOT / "benchmarks" / "results" / f".throughput-{'eager' if eager else 'graphs'}.json"
    cmd = [sys.executable, "-m", "fastgen", "bench", "throughput", "--load-format", "dummy",
           "--model-preset", args.preset, "--device", args.device, "--dtype", "bfloat16", "--quiet",
           "--num-prompts", str(args.num_prompts), "--input-len", args.input_len,
           "--output-len", args.output_len, "--max-num-seqs", "256", "--output-json", str(out)]
    if eager:
        cmd.append("--enforce-eager")
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    doc = json.loads(out.read_text())
    out.unlink()
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (the point); cpu only smoke-tests this script")
    parser.add_argument("--preset", default="qwen3-0.6b", help="model shape preset (dummy weights)")
    parser.add_argument("--batch-sizes", default="1,8,64,256", help="comma-separated decode batch sizes")
    parser.add_argument("--context-len", type=int, default=512, help="prompt tokens per sequence before decode")
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps per batch size")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", default="100:1024")
    parser.add_argument("--output-len", default="100:1024")
    parser.add_argument("--quick", action="store_true", help="30 steps and a 64-prompt throughput run")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/gpu-decode-<gpu>.json)")
    args = parser.parse_args(argv)
    args.batch_sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    if args.quick:
        args.steps, args.num_prompts = 30, 64
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA GPU is available")

    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    model_dir = preset_model_dir(args.preset)
    report = {
        "schema": "fastgen.bench.gpu-decode/1",
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "device": gpu,
        "versions": {"torch": torch.__version__, "triton": _version("triton"), "python": sys.version.split()[0]},
        "model": {"preset": args.preset, "dtype": "bfloat16", "weights": "dummy"},
        "settings": {"context_len": args.context_len, "steps": args.steps, "block_size": args.block_size},
        "decode": {},
    }
    for mode in ("graphs", "eager"):
        llm = build_llm(model_dir, eager=mode == "eager", args=args)
        report["decode"][mode] = {
            "attention_backend": llm.engine.runner.backend.name,
            "graphs": graph_info(llm),
            "steps": [decode_step_ms(llm, b, args) for b in args.batch_sizes],
        }
        for row in report["decode"][mode]["steps"]:
            print(f"{mode:6s} bs={row['batch_size']:4d} decode step median {row['median_ms']:.3f} ms", flush=True)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    graphs_rows = {r["batch_size"]: r for r in report["decode"]["graphs"]["steps"]}
    eager_rows = {r["batch_size"]: r for r in report["decode"]["eager"]["steps"]}
    report["speedup_graphs_over_eager"] = {
        str(b): eager_rows[b]["median_ms"] / graphs_rows[b]["median_ms"] for b in args.batch_sizes
    }
    if not args.skip_throughput:
        report["throughput"] = {"graphs": throughput(args, eager=False)["results"]}
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    path = Path(args.output or ROOT / "benchmarks" / "results" / f"gpu-decode-{slug}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["speedup_graphs_over_eager"], indent=2))
    print(f"wrote {path}")
    return 0


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
