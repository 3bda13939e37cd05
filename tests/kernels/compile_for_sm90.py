"""Compile every Triton kernel for an H100 (sm_90) on a machine without a GPU.

Triton's compiler needs no GPU: a stand-in driver reports an sm_90 target, and kernel launches
become compile-only warm-ups, so fastgen's own launchers run exactly as they would on the GPU
(grids, constexprs, dtypes) down to PTX and a cubin from Triton's bundled ptxas. Prints one
JSON line per compiled kernel: name, configuration, registers, spill stack bytes, shared memory.

    python tests/kernels/compile_for_sm90.py            # with the installed Triton
    PYTHONPATH=/path/to/triton-3.6/site-packages python tests/kernels/compile_for_sm90.py

It relies on two Triton internals (`driver.set_active` and `JITFunction.run(..., warmup=...)`),
both present from 3.2 to 3.6 and later; exit code 3 means this Triton lacks them.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # must be unset before any kernel is decorated
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

COMPILED: list[tuple[str, object]] = []


class Sm90Driver:
    """Just enough of a Triton driver to compile: device 0, stream 0, an sm_90 target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty):
        return ty


def install() -> bool:
    if "warmup" not in inspect.signature(JITFunction.run).parameters or not hasattr(driver, "set_active"):
        return False
    driver.set_active(Sm90Driver())
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        COMPILED.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = compile_only
    return True


def resource_usage(kernel) -> dict:
    """Registers, spill stack and shared memory of the cubin (cuobjdump ships with Triton)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = {"shared_bytes": kernel.metadata.shared, "num_warps": kernel.metadata.num_warps,
             "num_stages": kernel.metadata.num_stages, "tensor_core_ops": len(re.findall(r"\b(w?gmma|mma)\b",
                                                                                          kernel.asm["ptx"])),
             "grid_dependency_ops": len(re.findall(r"\bgriddepcontrol\.", kernel.asm["ptx"])),
             "atomic_ops": len(re.findall(r"\batom\.", kernel.asm["ptx"])),
             "spin_waits": len(re.findall(r"\bnanosleep\.", kernel.asm["ptx"])),
             "l2_prefetches": len(re.findall(r"\bprefetch\.global\.L2\b", kernel.asm["ptx"])),
             "clock_reads": len(re.findall(r"%globaltimer\b", kernel.asm["ptx"])),
             "register_limit": getattr(kernel.metadata, "maxnreg", None) or 0,
             "loads_before_wait": _loads_before_wait(kernel.asm["ptx"])}
    if tool.exists():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
        # The most any of the cubin's functions takes (a kernel's non-inlined functions are listed
        # apart from it).
        for key in ("REG", "STACK", "LOCAL"):
            found = [int(v) for v in re.findall(rf"\b{key}:(\d+)", text)]
            if found:
                usage[key.lower()] = max(found)
    return usage


def _loads_before_wait(ptx: str) -> int | None:
    """Global loads the PTX has ahead of its first `griddepcontrol.wait` (what a programmatic
    dependent reads while the kernel in front still runs); None without a wait."""
    wait = ptx.find("griddepcontrol.wait")
    return None if wait < 0 else len(re.findall(r"\bld\.global\b", ptx[:wait]))


@contextlib.contextmanager
def programmatic_launches():
    """The decode path's launchers as on an H100, where they launch as programmatic dependents
    (`kernels/programmatic_launch.py`): the stand-in device here is a CPU, which never does."""
    modules = [importlib.import_module(f"fastgen.kernels.{name}") for name in (
        "decode_layer", "normed_skinny_matmul", "paged_decode_attention", "qk_norm_rope_store", "skinny_matmul")]
    saved = [m.programmatic_launch for m in modules]
    for m in modules:
        m.programmatic_launch = lambda device: True
    try:
        yield
    finally:
        for m, launch in zip(modules, saved):
            m.programmatic_launch = launch


@contextlib.contextmanager
def decode_attention_switches(**values):
    """Decode attention's switches set (`COMBINE_IN_LAST_SPLIT`: its splits combined in the split
    kernel; `EARLY_CACHE_READS` and `EARLY_CACHE_READS_MAX_BATCH`: its first keys read before q,
    up to which batch), as before afterwards."""
    module = importlib.import_module("fastgen.kernels.paged_decode_attention")
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def with_and_without_pdl(tag: dict, launch):
    """Both variants of a decode-path launch."""
    yield tag | {"pdl": False}, launch

    def launch_pdl():
        with programmatic_launches():
            return launch()

    yield tag | {"pdl": True}, launch_pdl


def launch_everything() -> None:
    """Every kernel with the shapes fastgen gives it: Qwen3-0.6B-like (16 q / 8 kv heads, head
    dim 128), GQA groups 1-8, head dim 64, block sizes 16 and 256, bf16 and the fp32 test path."""
    from fastgen.kernels import paged_decode_attention, paged_prefill_attention, qk_norm_rope_store, store_kvcache
    from fastgen.kernels.paged_decode_attention import NewToken

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for group, head_dim, block_size in ((1, 128, 256), (2, 128, 256), (4, 64, 16), (8, 128, 16)):
            kv_heads = 8 // min(group, 4)
            tag = {"dtype": str(dtype).split(".")[1], "group": group, "head_dim": head_dim, "block_size": block_size}
            q = torch.zeros(4, kv_heads * group, head_dim, dtype=dtype)
            kv = torch.zeros(4, kv_heads, head_dim, dtype=dtype)
            cache = torch.zeros(8, block_size, kv_heads, head_dim, dtype=dtype)
            tables = torch.zeros(4, 8, dtype=torch.int32)
            lens = torch.zeros(4, dtype=torch.int32)
            starts = torch.zeros(5, dtype=torch.int32)
            slots = torch.zeros(4, dtype=torch.int64)
            cos_sin = torch.zeros(64, head_dim)
            weight = torch.ones(head_dim, dtype=dtype)
            for max_splits in (1, 8):
                yield from with_and_without_pdl(tag | {"max_splits": max_splits}, lambda m=max_splits: (
                    paged_decode_attention(q, cache, cache, tables, lens, 0.1, max_splits=m, early_cache_reads=False)))
                for norm in (True, False):
                    new_token = NewToken(kv, kv, slots, cos_sin, weight if norm else None, weight if norm else None,
                                         1e-6, slots)
                    yield from with_and_without_pdl(
                        tag | {"max_splits": max_splits, "new_token": True, "qk_norm": norm},
                        lambda m=max_splits, t=new_token: paged_decode_attention(
                            q, cache, cache, tables, lens, 0.1, max_splits=m, new_token=t, early_cache_reads=False))

                    def early(m=max_splits, t=new_token):
                        # Every batch: the batch here (4) is past the default's limit.
                        with decode_attention_switches(EARLY_CACHE_READS=True, EARLY_CACHE_READS_MAX_BATCH=None):
                            return paged_decode_attention(q, cache, cache, tables, lens, 0.1, max_splits=m, new_token=t)
                    yield from with_and_without_pdl(
                        tag | {"max_splits": max_splits, "new_token": True, "qk_norm": norm, "early_cache_reads": True},
                        early)
            for new_token in (None, NewToken(kv, kv, slots, cos_sin, weight, weight, 1e-6, slots)):
                def combined(t=new_token):
                    with decode_attention_switches(COMBINE_IN_LAST_SPLIT=True):
                        return paged_decode_attention(q, cache, cache, tables, lens, 0.1, max_splits=8, new_token=t,
                                                      early_cache_reads=False)
                yield from with_and_without_pdl(tag | {"max_splits": 8, "combine_in_split": True,
                                                       "new_token": new_token is not None}, combined)
            yield tag, lambda: paged_prefill_attention(q, cache, cache, tables, starts, lens, 100, 0.1)
            for norm in (True, False):
                yield from with_and_without_pdl(tag | {"qk_norm": norm}, lambda n=norm: qk_norm_rope_store(
                    q, kv, kv, slots, cos_sin, weight if n else None, weight if n else None, 1e-6, cache, cache, slots))
            yield tag, lambda: store_kvcache(kv, kv, cache, cache, slots)
    yield from _skinny_products()
    yield from _normed_products()
    yield from _decode_layers()


def _skinny_products():
    """The decode batches' product at Qwen3-0.6B's widths, 1-8 rows, its default tilings; and at
    one, two and four rows all of K in one step (`SKINNY_MAX_BLOCK_K`, timed by `gpu_decode.py`)."""
    from fastgen.kernels.skinny_matmul import SkinnyTiling, skinny_matmul

    for dtype in (torch.bfloat16, torch.float32):
        for n, k in ((4096, 1024), (1024, 2048), (1024, 3072)):
            for rows in (1, 2, 4, 8):
                x, weight = torch.zeros(rows, k, dtype=dtype), torch.zeros(n, k, dtype=dtype)
                tag = {"dtype": str(dtype).split(".")[1], "n": n, "k": k, "rows": rows}
                yield from with_and_without_pdl(tag, lambda x=x, w=weight: skinny_matmul(x, w))
                if k > 1024 and rows <= 4:
                    whole = SkinnyTiling(2, triton.next_power_of_2(k))
                    yield from with_and_without_pdl(tag | {"block_k": whole.block_k},
                                                    lambda x=x, w=weight, t=whole: skinny_matmul(x, w, tiling=t))


def _normed_products():
    """RMSNorm + q|k|v, and + gate|up + SwiGLU, at Qwen3-0.6B's and Llama-3-8B's widths, one and
    two rows (the default) and four (`SKINNY_MAX_ROWS_ON_CUDA`, timed by `gpu_decode.py`)."""
    from fastgen.kernels.normed_skinny_matmul import normed_skinny_matmul

    for dtype in (torch.bfloat16, torch.float32):
        for n, k, swiglu in ((4096, 1024, False), (6144, 1024, True), (6144, 4096, False), (28672, 4096, True)):
            for rows in (1, 2, 4):
                x, weight = torch.zeros(rows, k, dtype=dtype), torch.zeros(n, k, dtype=dtype)
                norm = torch.ones(k, dtype=dtype)
                tag = {"dtype": str(dtype).split(".")[1], "n": n, "k": k, "rows": rows, "swiglu": swiglu}
                yield from with_and_without_pdl(tag, lambda x=x, w=weight, g=norm, s=swiglu: normed_skinny_matmul(
                    x, x, g, 1e-6, w, swiglu=s))


def _decode_layers():
    """A whole layer's decode step in one launch at Qwen3-0.6B's, Qwen2-0.5B's and Llama-3.2-1B's
    shapes (hidden, heads, KV heads, head dim, intermediate), one and two rows."""
    from fastgen.kernels.decode_layer import (
        DecodeLayerWeights,
        LayerCounters,
        LayerTrace,
        decode_layer,
        default_layer_tiling,
    )
    from fastgen.kernels.decode_split_policy import DEFAULT_NUM_SMS  # the SMs decode_layer sizes for off a GPU

    shapes = {"qwen3-0.6b": (1024, 16, 8, 128, 3072, True, False), "qwen2-0.5b": (896, 14, 2, 64, 4864, False, True),
              "llama-3.2-1b": (2048, 32, 8, 64, 8192, False, False)}
    for dtype in (torch.bfloat16, torch.float32):
        for name, (hidden, heads, kv_heads, head_dim, inter, qk_norm, bias) in shapes.items():
            def zeros(*shape):
                return torch.zeros(*shape, dtype=dtype)

            n_qkv = (heads + 2 * kv_heads) * head_dim
            w = DecodeLayerWeights(zeros(hidden), zeros(n_qkv, hidden), zeros(n_qkv) if bias else None,
                                   zeros(head_dim) if qk_norm else None, zeros(head_dim) if qk_norm else None,
                                   zeros(hidden, heads * head_dim), zeros(hidden), zeros(2 * inter, hidden),
                                   zeros(hidden, inter), heads, kv_heads, head_dim, 1e-6, 1e-6)
            cache = zeros(8, 256, kv_heads, head_dim)
            for rows in (1, 2):
                x = zeros(rows, hidden)
                args = (torch.zeros(rows, dtype=torch.int64), torch.zeros(64, head_dim), cache, cache,
                        torch.zeros(rows, 8, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32),
                        torch.zeros(rows, dtype=torch.int64), 0.1, LayerCounters(torch.device("cpu")))
                tag = {"dtype": str(dtype).split(".")[1], "layer": name, "rows": rows}
                yield from with_and_without_pdl(tag, lambda x=x, w=w, a=args: decode_layer(x, x, w, *a))
                if dtype == torch.bfloat16:  # persistent programs (two an H100 SM), as the layer sweep tries them
                    persistent = replace(default_layer_tiling(hidden), persistent_programs=2 * DEFAULT_NUM_SMS)
                    yield from with_and_without_pdl(tag | {"persistent": True}, lambda x=x, w=w, a=args,
                                                    t=persistent: decode_layer(x, x, w, *a, t))
                if dtype == torch.bfloat16 and rows == 1:  # traced, as the layer sweep runs it once
                    yield tag | {"traced": True}, lambda x=x, w=w, a=args: decode_layer(x, x, w, *a, None,
                                                                                          LayerTrace())


def main() -> int:
    if not install():
        print(f"triton {triton.__version__} lacks the internals this script drives", file=sys.stderr)
        return 3
    failures = 0
    for tag, launch in launch_everything():
        COMPILED.clear()
        try:
            launch()
        except Exception as exc:  # noqa: BLE001 - report every configuration, then fail
            failures += 1
            print(json.dumps({"config": tag, "error": f"{type(exc).__name__}: {exc}"[:2000]}), flush=True)
            continue
        for name, kernel in COMPILED:
            print(json.dumps({"kernel": name, "config": tag, "triton": triton.__version__} | resource_usage(kernel)),
                  flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
