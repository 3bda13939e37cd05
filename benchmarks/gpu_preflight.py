"""A one-minute check that a GPU machine can run `make gpu-check` at all, before it spends its
time on the tests and the benchmark: a C compiler for Triton's launchers, one Triton kernel
compiled and equal to its torch twin, one tiny model's decode CUDA graphs equal to its eager
decode, and the GPU's name, driver and clocks recorded. Prints one line per check, writes
DIR/gpu-preflight-<device>.json, and exits 1 on the first failure with what failed:

    python3 benchmarks/gpu_preflight.py [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def check_compiler() -> dict:
    found = {name: shutil.which(name) for name in ("cc", "gcc", "clang")}
    if not any(found.values()):
        raise RuntimeError("no C compiler on PATH: Triton cannot build its kernel launchers")
    return found


def check_gpu() -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA GPU")
    from benchmarks.gpu_measure import driver_info

    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "sms": props.multi_processor_count, "memory_gib": props.total_memory / 2**30,
            "capability": f"{props.major}.{props.minor}", "torch": torch.__version__, "cuda": torch.version.cuda,
            "nvidia_smi": driver_info()}


def check_triton_kernel() -> dict:
    import triton

    from kernels.paged_attention_torch import paged_decode_attention_torch
    from kernels.paged_decode_attention import paged_decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(9, 16, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.randperm(8, device="cuda", generator=g).to(torch.int32).view(2, 4)
    lens = torch.tensor([37, 64], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 4, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    start = time.perf_counter()
    out = paged_decode_attention(q, k, v, tables, lens, 0.125)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ref = paged_decode_attention_torch(q.float(), k.float(), v.float(), tables, lens, 0.125)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    if not err < 1e-2:
        raise RuntimeError(f"paged decode attention differs from its torch twin: relative error {err:.2e}")
    return {"triton": triton.__version__, "compile_and_run_s": seconds, "relative_error": err}


def check_decode_graphs() -> dict:
    from fastgen import LLM, SamplingParams
    from tests.tiny_models import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model("llama", Path(tmp) / "llama"))
        prompts = [[5, 17, 42, 9], list(range(3, 40))]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        args = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=32, max_num_seqs=2, max_model_len=128)
        start = time.perf_counter()
        graphed = LLM(model, cuda_graph_batch_sizes=[1, 2], enforce_eager=False, **args)
        if graphed.engine.runner.graphs is None:
            raise RuntimeError("the engine captured no decode graphs")
        with_graphs = [o.token_ids for o in graphed.generate(prompts, params)]
        seconds = time.perf_counter() - start
        del graphed
        eager = [o.token_ids for o in LLM(model, enforce_eager=True, **args).generate(prompts, params)]
    if with_graphs != eager:
        raise RuntimeError(f"decode graphs gave {with_graphs}, eager decode {eager}")
    return {"tokens": with_graphs, "build_capture_generate_s": seconds}


CHECKS = (("compiler", check_compiler), ("gpu", check_gpu), ("triton kernel", check_triton_kernel),
          ("decode graphs", check_decode_graphs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default=os.environ.get("FASTGEN_BENCH_DIR", str(ROOT / "benchmarks" / "results")))
    args = p.parse_args(argv)
    report: dict = {}
    status = 0
    for name, check in CHECKS:
        start = time.perf_counter()
        try:
            report[name] = {"ok": True, **check(), "seconds": time.perf_counter() - start}
            print(f"ok    {name} ({report[name]['seconds']:.1f}s)", flush=True)
        except Exception as exc:  # noqa: BLE001 - the report says what failed, then stops
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            print(f"FAIL  {name}: {type(exc).__name__}: {exc}", flush=True)
            status = 1
            break
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks.gpu_measure import device_slug

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    (out / f"gpu-preflight-{device_slug(name)}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
