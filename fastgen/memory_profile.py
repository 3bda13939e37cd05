"""How much GPU memory the KV cache may take: measured, not guessed.

Runs a peak-sized prefill (max_num_batched_tokens tokens) and, when graphs are on, an eager
decode at the largest capture size, against a one-block stand-in cache with every slot -1 (so
nothing is written), and records the activation peak of each. The KV budget is then
    total * gpu_memory_utilization - memory in use (context, weights, other processes)
    - prefill activation peak - decode-graph reserve.
The decode run stands in for the graphs' private memory pool, which holds the same activations.
"""

from __future__ import annotations

import logging

import torch

from fastgen.scheduler import SchedulerOutput
from fastgen.sequence import Sequence
from fastgen.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _peak_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def peak_prefill_lengths(config) -> list[int]:
    """Prompt lengths of the largest prefill step the scheduler can form: as many
    max_model_len-or-shorter prompts as fill the token budget, and no more than max_num_seqs."""
    tokens = config.max_num_batched_tokens
    lengths: list[int] = []
    while tokens > 0 and len(lengths) < config.max_num_seqs:
        lengths.append(min(tokens, config.max_model_len))
        tokens -= lengths[-1]
    return lengths


@torch.inference_mode()
def profile_kv_budget(runner) -> int:
    config = runner.config
    mc = config.model_config
    stand_in = torch.zeros(
        (2, mc.num_layers, 1, config.block_size, mc.num_kv_heads, mc.head_dim),
        dtype=config.torch_dtype, device=runner.device,
    )
    runner.bind_kv_cache(stand_in)

    lengths = peak_prefill_lengths(config)
    # Negative ids never collide with real sequences (-1 marks padding rows in the builder).
    seqs = [Sequence(-2 - i, [0] * n, SamplingParams()) for i, n in enumerate(lengths)]
    for seq in seqs:
        seq.block_table = [0] * config.max_blocks_per_seq
    prefill = SchedulerOutput(seqs, lengths, is_prefill=True)

    def run_prefill():
        inputs = runner.inputs.build_prefill(prefill)
        slots = inputs.meta.slot_mapping
        slots.fill_(-1)  # the stand-in cache has one block: write nothing
        runner.forward_logits(inputs)

    prefill_peak = _peak_bytes(run_prefill)
    graph_reserve = 0
    if config.graphs_enabled:
        size = max(runner.capture_sizes)
        empty = SchedulerOutput([], [], is_prefill=False)
        graph_reserve = _peak_bytes(lambda: runner.forward_logits(runner.inputs.build_decode(empty, pad_to=size)))
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    in_use = total - free
    budget = int(total * config.gpu_memory_utilization) - in_use - prefill_peak - graph_reserve
    logger.info(
        "GPU memory: total %.2f GiB, in use %.2f GiB, prefill peak %.2f GiB, graph reserve %.2f GiB "
        "-> KV budget %.2f GiB",
        *(x / 2**30 for x in (total, in_use, prefill_peak, graph_reserve, max(budget, 0))),
    )
    return max(budget, 0)
