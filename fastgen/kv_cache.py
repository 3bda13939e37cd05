"""Sizing and allocating the one paged KV-cache tensor."""

from __future__ import annotations

import torch

from fastgen.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig


def bytes_per_block(config: EngineConfig) -> int:
    return config.block_size * config.model_config.kv_bytes_per_token(config.torch_dtype)


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


def allocate_kv_cache(config: EngineConfig, num_blocks: int) -> torch.Tensor:
    """[2, layers, blocks, block_size, kv_heads, head_dim], zero-filled so that masked-out reads
    of never-written slots can only ever see finite values."""
    mc = config.model_config
    shape = (2, mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
    return torch.zeros(shape, dtype=config.torch_dtype, device=config.torch_device)
