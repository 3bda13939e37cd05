"""The paged KV cache: how many blocks fit, measuring what a GPU can spare, and allocating it.

On CUDA the budget is measured, not guessed: a peak-sized prefill (max_num_batched_tokens
tokens) and, when graphs are on, an eager decode at the largest capture size run against a
one-block stand-in cache with every slot -1 (so nothing is written), and the activation peak of
each is recorded. The KV budget is then
    total * gpu_memory_utilization - memory in use (context, weights, other processes)
    - prefill activation peak - decode-graph reserve.
The decode run stands in for the graphs' private memory pool, which holds the same activations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from fastgen.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from fastgen.engine.scheduler import SchedulerOutput
from fastgen.engine.sequence import Sequence
from fastgen.sampling_params import SamplingParams
from fastgen.worker.step_inputs import StepInputBuilder, StepInputs

logger = logging.getLogger(__name__)


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


# ---- measuring the GPU budget ----------------------------------------------------------------
ForwardLogits = Callable[[StepInputs, list], torch.Tensor]  # (inputs, kv layers) -> logits


def _peak_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def peak_prefill_lengths(config: EngineConfig) -> list[int]:
    """Prompt lengths of the largest prefill step the scheduler can form: as many
    max_model_len-or-shorter prompts as fill the token budget, and no more than max_num_seqs."""
    tokens = config.max_num_batched_tokens
    lengths: list[int] = []
    while tokens > 0 and len(lengths) < config.max_num_seqs:
        lengths.append(min(tokens, config.max_model_len))
        tokens -= lengths[-1]
    return lengths


@torch.inference_mode()
def measure_kv_budget(config: EngineConfig, forward_logits: ForwardLogits, graph_batch_size: int | None) -> int:
    """Bytes the KV cache may take on this GPU (see the module docstring); 0 when none are left.

    forward_logits: runs the model on a step's inputs and cache layers. graph_batch_size: the
    largest decode graph to reserve for, or None when graphs are off.
    """
    prefill_peak, graph_reserve = _activation_peaks(config, forward_logits, graph_batch_size)
    torch.cuda.empty_cache()  # the stand-in cache and the profiling builder are gone by now
    free, total = torch.cuda.mem_get_info(config.torch_device)
    in_use = total - free
    budget = int(total * config.gpu_memory_utilization) - in_use - prefill_peak - graph_reserve
    logger.info(
        "GPU memory: total %.2f GiB, in use %.2f GiB, prefill peak %.2f GiB, graph reserve %.2f GiB "
        "-> KV budget %.2f GiB",
        *(x / 2**30 for x in (total, in_use, prefill_peak, graph_reserve, max(budget, 0))),
    )
    return max(budget, 0)


def _activation_peaks(config: EngineConfig, forward_logits: ForwardLogits,
                      graph_batch_size: int | None) -> tuple[int, int]:
    """(peak bytes of the largest prefill step, of the largest decode graph's forward or 0)."""
    stand_in = KVCache(config, num_blocks=1)
    # A builder of its own: the engine's keeps per-sequence rows that fake sequences must not touch.
    inputs = StepInputBuilder(config.max_num_seqs, config.max_num_batched_tokens, config.max_blocks_per_seq,
                              config.block_size, config.torch_device)
    lengths = peak_prefill_lengths(config)
    # Negative ids never collide with real sequences.
    seqs = [Sequence(-2 - i, [0] * n, SamplingParams()) for i, n in enumerate(lengths)]
    for seq in seqs:
        seq.block_table = [0] * config.max_blocks_per_seq
    prefill = SchedulerOutput(seqs, lengths, True, [True] * len(seqs), [()] * len(seqs))

    def run_prefill():
        step = inputs.build_prefill(prefill)
        step.meta.slot_mapping.fill_(-1)  # the stand-in cache has one block: write nothing
        forward_logits(step, stand_in.layers)

    def run_decode():
        step = inputs.build_decode(SchedulerOutput.empty_decode(), pad_to=graph_batch_size)
        forward_logits(step, stand_in.layers)

    prefill_peak = _peak_bytes(run_prefill)
    graph_reserve = _peak_bytes(run_decode) if graph_batch_size is not None else 0
    return prefill_peak, graph_reserve
