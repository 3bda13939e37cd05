"""What a benchmark ran on: the machine, the software versions and the engine's settings.

These land in the report next to the numbers, so a result can be reproduced and two results
can be told apart (another GPU, another torch, CUDA graphs off).
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

from fastgen.cpu.native.features import cpu_model_name


def device_name(device: torch.device) -> str:
    """The GPU's marketing name on CUDA, else the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model_name() or platform.processor() or platform.machine() or "unknown CPU"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment_info(device: torch.device) -> dict:
    import fastgen

    return {
        "device_type": device.type,
        "device_name": device_name(device),
        "num_cpus": os.cpu_count(),
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "torch_version": torch.__version__,
        "triton_version": _version("triton"),
        "transformers_version": _version("transformers"),
        "fastgen_version": fastgen.__version__,
        **git_revision(),
    }


def git_revision() -> dict:
    """The commit of the fastgen source that ran (`git_revision`) and whether it had local
    changes (`git_dirty`), when it runs from a git checkout; both None otherwise."""
    source = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        status = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"git_revision": None, "git_dirty": None}
    if head.returncode != 0 or status.returncode != 0:
        return {"git_revision": None, "git_dirty": None}
    return {"git_revision": head.stdout.strip(), "git_dirty": bool(status.stdout.strip())}


def reset_peak_memory(device: torch.device) -> None:
    """Start a fresh CUDA peak (weights and KV cache stay allocated, so they still count).
    The CPU peak RSS cannot be reset: it covers the whole process."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: torch.cuda.max_memory_allocated since the last reset. CPU: the process's peak
    resident set size (ru_maxrss: KiB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a host timer measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_settings(llm, choice) -> dict:
    """The settings the engine actually runs with (after defaults and sizing were applied).

    llm: a `fastgen.LLM`; choice: the `fastgen.cli.engine_args.ModelChoice` it was built from.
    """
    config = llm.config
    runner = llm.engine.runner
    mc = config.model_config
    num_parameters, weight_bytes = weight_sizes(runner.model)
    return {
        "model": config.model,
        "model_preset": choice.preset,
        "load_format": choice.load_format,
        "architecture": mc.architecture,
        "num_parameters": num_parameters,
        "dtype": config.dtype_name,
        "quantization": config.quantization,
        "weight_bytes": weight_bytes,
        "device": str(runner.device),
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_model_len": config.max_model_len,
        "num_kv_blocks": runner.num_kv_blocks,
        "kv_cache_bytes": runner.kv_cache.num_bytes,
        "enable_prefix_caching": config.enable_prefix_caching,
        "speculative_config": config.speculative_config,
        "enforce_eager": config.enforce_eager,
        "cuda_graphs": runner.graphs is not None,
        "compiled_decode": runner.compiled_decode is not None,
        "compile_mode": config.compile_mode,
        **engine_compile_times(llm.engine),
        "torch_compile": config.compile_enabled,
        "attention_backend": runner.backend.name,
        "seed": config.seed,
        # Every EngineConfig field (defaults applied), so the engine of a run can be rebuilt.
        "config": config.init_values(),
    }


def weight_sizes(model) -> tuple[int, int]:
    """(weights, bytes) of `model` as held, tied ones once: a quantized matrix counts its weights
    (two 4-bit codes a byte; its scales and minimums are no weights) and the bytes of its codes,
    scales and minimums (`fastgen.layers.quantizable`)."""
    count = nbytes = 0
    for name, p in model.named_parameters():
        nbytes += p.numel() * p.element_size()
        if not name.endswith(("weight_scales", "weight_mins")):
            count += p.numel() * (2 if name.endswith("weight_codes") and p.dtype == torch.uint8 else 1)
    return count, nbytes


def engine_compile_times(engine) -> dict:
    """`compile_times` of the engine's runner, and of its draft model's (speculative decoding),
    whose graphs are named `draft:<graph>` and whose time counts in `compile_s` too."""
    times = compile_times(engine.runner)
    drafter = engine.drafter
    if drafter is not None and drafter.model is not None:
        draft = compile_times(drafter.model.runner)
        times["compile_s"] += draft["compile_s"]
        times["compiled_graphs"].update({f"draft:{name}": graph for name, graph in draft["compiled_graphs"].items()})
    return times


def compile_times(runner) -> dict:
    """What building the fast steps cost, apart from the measurement: each compiled CPU graph's
    first call (compiling or loading it, plus its first run), whether it came from the cache, and
    for a graph a helper process compiled meanwhile, the helper's time (`helper_s`); the wait
    for the helpers counts in `compile_s`. The CUDA graphs' warm-up and capture."""
    times: dict = {"compile_s": 0.0, "compiled_graphs": {}}
    if (compiled := runner.compiled_decode) is not None:
        graphs = {name: {"seconds": seconds, "from_cache": name in compiled.loaded}
                  for name, seconds in compiled.first_call_seconds.items()}
        times["compile_s"] = sum(compiled.first_call_seconds.values())
        if (helpers := compiled.helpers) is not None:
            for name, seconds in helpers.seconds.items():
                graphs.setdefault(name, {"seconds": 0.0, "from_cache": False})["helper_s"] = seconds
            times["compile_s"] += helpers.wait_seconds
        times["compiled_graphs"] = graphs
    if (graphs := runner.graphs) is not None:
        times["compile_s"] = graphs.warmup_seconds + graphs.capture_seconds
        times["compiled_graphs"] = {"cuda_graphs": {"seconds": times["compile_s"], "from_cache": False}}
    return times
