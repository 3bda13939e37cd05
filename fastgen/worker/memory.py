"""What start-up may allocate, checked against what the machine has before anything is allocated.

A setting that asks for more than the machine has (10**12 KV blocks, a step buffer for 10**12
tokens, a config.json describing a model larger than memory) must fail as a ValueError naming the
setting, its value and the limit, not as an allocator RuntimeError or a visit from the OOM
killer. The limit is the memory available now: host RAM (within the process's cgroup limit, if
any) on CPU, the device's free memory on CUDA.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fastgen.config import EngineConfig
from fastgen.models.config import DTYPE_BYTES
from fastgen.worker.kv_cache import bytes_per_block
from fastgen.worker import step_inputs
from fastgen.worker.step_inputs import StepInputBuilder

_CGROUP_V2 = Path("/sys/fs/cgroup")


def _system_available_bytes() -> int:
    try:
        import psutil
    except ImportError:  # a bare GPU machine may lack it; Linux keeps the same figure here
        meminfo = Path("/proc/meminfo")
        for line in meminfo.read_text().splitlines() if meminfo.is_file() else []:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return psutil.virtual_memory().available


def available_host_bytes() -> int:
    """Host memory this process can still take: the system's available memory, or what is left
    under a cgroup v2 memory limit when that is less."""
    available = _system_available_bytes()
    try:
        limit = (_CGROUP_V2 / "memory.max").read_text().strip()
        if limit != "max":
            used = int((_CGROUP_V2 / "memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


def available_bytes(device: torch.device) -> int:
    """Free memory on `device` (host RAM for CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_bytes()


def check_fits(what: str, needed: int, device: torch.device, advice: str) -> None:
    """Raise ValueError when `needed` bytes exceed what `device` has available. `what` names the
    settings and their values; `advice` says which to change."""
    available = available_bytes(device)
    if needed > available:
        where = "host memory" if device.type == "cpu" else f"free memory on {device}"
        raise ValueError(f"{what} needs {_size(needed)}, more than the {_size(available)} of {where} "
                         f"available; {advice}")


def _size(num_bytes: int) -> str:
    return f"{num_bytes} bytes ({num_bytes / 2**30:.3g} GiB)"


# ---- what start-up allocates ----------------------------------------------------------------
def host_bytes_per_block(block_size: int) -> int:
    """The block manager's Python bookkeeping for one block (its record, free-list and prefix-cache
    entries, the stored token ids of a keyed block), measured and rounded up."""
    return 384 + 40 * block_size


def check_model_fits(config: EngineConfig) -> None:
    """The weights (from config.json's shapes) and the RoPE tables, before the model is built."""
    mc = config.model_config
    weights = mc.num_parameters() * DTYPE_BYTES[config.dtype_name]
    rope = 2 * config.max_model_len * mc.head_dim * 4  # float32 cos|sin table, and its making
    check_fits(
        f"the model in {config.model}/config.json (hidden_size={mc.hidden_size}, num_hidden_layers={mc.num_layers}, "
        f"intermediate_size={mc.intermediate_size}, vocab_size={mc.vocab_size}, {config.dtype_name}) with "
        f"max_model_len={config.max_model_len}",
        weights + rope, config.torch_device, "use a smaller model, dtype or max_model_len",
    )


def check_step_inputs_fit(config: EngineConfig) -> None:
    """The step-input buffers (the host rows; on CUDA also their packed pinned copy and the
    device's), before they are allocated."""
    drafts = config.speculative_config["num_speculative_tokens"] if config.speculative_config else 0
    per_copy = StepInputBuilder.num_bytes(config.max_num_seqs, config.max_num_batched_tokens,
                                          config.max_blocks_per_seq, drafts)
    what = (f"the step-input buffers for max_num_seqs={config.max_num_seqs}, max_num_batched_tokens="
            f"{config.max_num_batched_tokens}, max_model_len={config.max_model_len} and "
            f"block_size={config.block_size}")
    advice = "lower max_num_seqs, max_num_batched_tokens or max_model_len, or raise block_size"
    device = config.torch_device
    packed = device.type == "cuda" and step_inputs.PACK_UPLOADS_ON_CUDA  # host rows and their packed copy
    check_fits(what, per_copy * (2 if packed else 1), torch.device("cpu"), advice)
    if device.type == "cuda":
        check_fits(what, per_copy, device, advice)


def check_kv_cache_fits(config: EngineConfig, num_blocks: int) -> None:
    """The KV cache tensor on its device and the blocks' bookkeeping on the host, before either is
    allocated; the message names the setting the block count came from."""
    per_block = bytes_per_block(config)
    if config.num_kv_blocks is not None:
        what, advice = f"num_kv_blocks={num_blocks} ({per_block} bytes a block)", "lower num_kv_blocks"
    elif config.kv_cache_memory_bytes is not None:
        what = f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} ({num_blocks} blocks of {per_block} bytes)"
        advice = "lower kv_cache_memory_bytes"
    else:
        what = f"the KV cache budget ({num_blocks} blocks of {per_block} bytes)"
        advice = "set a smaller kv_cache_memory_bytes or num_kv_blocks"
    device, host = config.torch_device, torch.device("cpu")
    bookkeeping = num_blocks * host_bytes_per_block(config.block_size)
    if device.type == "cuda":
        check_fits(what, num_blocks * per_block, device, advice)
        check_fits(what, bookkeeping, host, advice)
    else:
        check_fits(what, num_blocks * per_block + bookkeeping, host, advice)
