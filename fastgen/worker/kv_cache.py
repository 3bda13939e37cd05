"""The paged KV cache: how many blocks fit a budget, and allocating it. On CUDA the budget is
measured (`fastgen.worker.memory_profile`)."""

from __future__ import annotations

import torch

from fastgen.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig


class KVCache:
    """One tensor [2, layers, blocks, block_size, kv_heads, head_dim], zero-filled so that
    masked-out reads of never-written slots can only ever see finite values; `layers` holds
    each layer's (k_cache, v_cache) views, made once, handed down every forward."""

    def __init__(self, config: EngineConfig, num_blocks: int, device: torch.device | None = None):
        mc = config.model_config
        shape = (2, mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
        self.num_blocks = num_blocks
        self.tensor = torch.zeros(shape, dtype=config.torch_dtype, device=device or config.torch_device)
        self.layers = [(self.tensor[0, i], self.tensor[1, i]) for i in range(mc.num_layers)]

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, K and V), each (source, destination) block id: how a
        forked sequence gets its own copy of its parent's partial last block."""
        src, dst = torch.tensor(copies, dtype=torch.int64).to(self.tensor.device, non_blocking=True).unbind(1)
        self.tensor.index_copy_(2, dst, self.tensor.index_select(2, src))


def bytes_per_block(config: EngineConfig) -> int:
    return config.block_size * config.model_config.kv_bytes_per_token(config.dtype_name)


def num_blocks_for_budget(config: EngineConfig, budget_bytes: int | None) -> int:
    """Blocks that fit the budget. `num_kv_blocks` wins; a None budget means the CPU default."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    # `is None`, not `or`: a measured budget of 0 (the GPU is full) must fail the fit check, not
    # fall back to the CPU default.
    budget = config.kv_cache_memory_bytes
    if budget is None:
        budget = budget_bytes if budget_bytes is not None else DEFAULT_CPU_KV_CACHE_BYTES
    return budget // bytes_per_block(config)


def check_fits_one_sequence(config: EngineConfig, num_blocks: int) -> None:
    """Every request that passes validation must be able to run alone: refuse to start otherwise."""
    needed = config.max_blocks_per_seq
    if num_blocks < needed:
        per_block = bytes_per_block(config)
        raise ValueError(
            f"KV cache budget holds {num_blocks} blocks of {config.block_size} tokens "
            f"({num_blocks * per_block} bytes), but one max_model_len={config.max_model_len} sequence "
            f"needs {needed} blocks ({needed * per_block} bytes); raise the budget "
            "(kv_cache_memory_bytes, num_kv_blocks or gpu_memory_utilization) or lower max_model_len"
        )


def needs_measured_budget(config: EngineConfig) -> bool:
    """On CUDA, unless the user fixed the budget, the cache gets what the GPU can spare."""
    return config.torch_device.type == "cuda" and not config.kv_cache_memory_bytes and not config.num_kv_blocks
