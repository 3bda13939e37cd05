"""The paged KV cache: how many blocks fit a budget, and allocating it. On CUDA the budget is
measured (`fastgen.worker.memory_profile`)."""

from __future__ import annotations

import torch

from fastgen.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from fastgen.models.config import DTYPE_BYTES, ModelConfig


class KVCache:
    """Per layer, a K and a V tensor [blocks, block_size, kv_heads, head_dim] (kv_heads: this
    rank's share under tensor parallelism, `EngineConfig.num_kv_heads_per_rank`), zero-filled so
    that masked-out reads of never-written slots can only ever see finite values; `layers` holds
    each layer's (k_cache, v_cache), handed down every forward.

    Each is an allocation of its own, not a view of one cache-wide tensor: the compiled CPU
    decode step takes them as inputs and writes them in place, which torch.compile does only for
    inputs that alias nothing (a store into a view of a shared base was traced into a copy of the
    whole base)."""

    def __init__(self, config: EngineConfig, num_blocks: int, device: torch.device | None = None):
        mc = config.model_config
        shape = (num_blocks, config.block_size, config.num_kv_heads_per_rank, mc.head_dim)
        self.num_blocks = num_blocks
        device = device or config.torch_device

        def empty_cache() -> torch.Tensor:
            return torch.zeros(shape, dtype=config.torch_dtype, device=device)

        self.layers = [(empty_cache(), empty_cache()) for _ in range(mc.num_layers)]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, K and V), each (source, destination) block id: how a
        forked sequence gets its own copy of its parent's partial last block."""
        device = self.layers[0][0].device
        src, dst = torch.tensor(copies, dtype=torch.int64).to(device, non_blocking=True).unbind(1)
        for layer in self.layers:
            for cache in layer:
                cache.index_copy_(0, dst, cache.index_select(0, src))


def bytes_per_block(config: EngineConfig) -> int:
    """Bytes of one block on one device (a tensor-parallel rank holds its KV heads only)."""
    return config.block_size * config.model_config.kv_bytes_per_token(config.dtype_name, config.num_kv_heads_per_rank)


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


def share_with_draft_model(config: EngineConfig, budget_bytes: int) -> int:
    """What a measured KV budget leaves the engine's own cache when a draft model (speculative
    decoding) is loaded after it: the draft's weights come off the top, and the rest is split so
    that the draft's cache gets as many blocks as the engine's. (A budget the user fixed, in
    bytes or blocks, is the engine's own: the draft's weights and cache come on top of it.)"""
    spec = config.speculative_config
    if spec is None or spec["method"] != "draft_model":
        return budget_bytes
    draft = ModelConfig.from_folder(spec["model"])
    # Quantized: a code a weight and a float scale (and minimum) per group of 32, about.
    per_weight = {None: DTYPE_BYTES[config.dtype_name], "int8": 1.25, "int4": 0.75}[spec["quantization"]]
    weights = int(draft.num_parameters() * per_weight)
    own = bytes_per_block(config)
    theirs = config.block_size * draft.kv_bytes_per_token(config.dtype_name)
    return max(0, budget_bytes - weights) * own // (own + theirs)


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
