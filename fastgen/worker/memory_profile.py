"""What a GPU can spare for the KV cache, measured by running the worst steps before it exists.

Two steps run against a one-block stand-in cache with every slot -1 (nothing is written; every
block-table entry is 0, so attention reads that one block as if it were a long history):

* the worst prefill the scheduler can form (`worst_prefill_step`): max_num_batched_tokens new
  tokens, as many sequences as a step may hold (each reaching its last prompt token, so each
  samples), and one of them the last chunk of a max_model_len context (what chunked prefill
  and prefix-cache hits attend over); sampled with top-k and top-p, the sampler's costliest path,
  but for one greedy row (see PROFILE_PARAMS);
* when graphs are on, a decode at the largest capture size: the forward, LM head and greedy
  argmax the graph captures, then the same sampling. It stands in for the graphs' private
  memory pool.

The KV budget is then
    total * gpu_memory_utilization - memory in use (context, weights, other processes)
    - prefill peak - decode peak.
Counting both peaks in full over-reserves by at most the smaller one's transient part; it never
under-reserves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from fastgen.config import EngineConfig
from fastgen.sampling_params import SamplingParams
from fastgen.scheduler_output import SchedulerOutput
from fastgen.sequence import Sequence
from fastgen.worker.kv_cache import KVCache
from fastgen.worker.step_inputs import PrepareMeta, StepInputBuilder, StepInputs

logger = logging.getLogger(__name__)

# The sampler's costliest settings: temperature scaling, a sort for top-k and top-p. The last
# row of a profiled step is greedy, which costs more than none: the sampled rows are gathered out
# of the batch's logits into a copy of their own.
PROFILE_PARAMS = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=1)
PROFILE_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def profile_params(i: int, count: int) -> SamplingParams:
    """Row i's settings in a profiled step of `count` sampled rows."""
    return PROFILE_GREEDY if count > 1 and i == count - 1 else PROFILE_PARAMS
# (step inputs, the step's sequences, kv layers) -> runs the model and samples every sampling row.
RunStep = Callable[[StepInputs, list[Sequence], list], object]


def worst_prefill_step(config: EngineConfig) -> SchedulerOutput:
    """The largest prefill step the scheduler can form, as a SchedulerOutput over stand-in
    sequences (negative ids, every block-table entry 0).

    min(max_num_seqs, max_num_batched_tokens) sequences share max_num_batched_tokens tokens (the
    first ones as long as a sequence may be, the others one token each); every chunk ends its
    prompt, so every sequence samples; the first sequence's chunk ends a max_model_len context.
    """
    tokens, max_len = config.max_num_batched_tokens, config.max_model_len
    count = min(config.max_num_seqs, tokens)
    chunks, rest = [1] * count, tokens - count
    for i in range(count):
        grow = min(rest, max_len - 1)
        chunks[i] += grow
        rest -= grow
    seqs = []
    for i, chunk in enumerate(chunks):
        length = max_len if i == 0 else chunk
        seq = Sequence(-2 - i, [0] * length, profile_params(i, count))
        seq.num_computed_tokens = length - chunk
        seq.block_table = [0] * config.max_blocks_per_seq
        seqs.append(seq)
    return SchedulerOutput(seqs, chunks, True, [True] * count, [()] * count)


def worst_verify_step(config: EngineConfig) -> SchedulerOutput | None:
    """Speculative decoding's largest verify step (None without speculation): as many decoding
    sequences as the token budget holds with num_speculative_tokens drafts each (fewer drafts
    when the budget is smaller), every position a logits row that is sampled, the first sequence
    drafting up to a max_model_len context. It can hold more logits rows than any prefill step,
    which samples once a sequence."""
    spec = config.speculative_config
    if not spec:
        return None
    k = min(spec["num_speculative_tokens"], config.max_num_batched_tokens - 1, config.max_model_len - 1)
    count = max(1, min(config.max_num_seqs, config.max_num_batched_tokens // (1 + k)))
    seqs = []
    for i in range(count):
        length = config.max_model_len - k if i == 0 else 1
        seq = Sequence(-2 - i, [0] * length, PROFILE_PARAMS)
        seq.num_computed_tokens = length - 1
        seq.block_table = [0] * config.max_blocks_per_seq
        seqs.append(seq)
    return SchedulerOutput(seqs, [1 + k] * count, True, [True] * count, [()] * count, num_decodes=count,
                           draft_tokens=((0,) * k,) * count)


def _activation_peaks(config: EngineConfig, run_step: RunStep, graph_batch_size: int | None,
                      prepare_meta: PrepareMeta) -> tuple[int, int]:
    """(peak bytes of the worst prefill or verify step, of the largest decode graph's step or 0)."""
    stand_in = KVCache(config, num_blocks=1)
    verify = worst_verify_step(config)
    max_drafts = len(verify.draft_tokens[0]) if verify is not None else 0
    # A builder of its own: the engine's keeps per-sequence rows that fake sequences must not touch.
    inputs = StepInputBuilder(config.max_num_seqs, config.max_num_batched_tokens, config.max_blocks_per_seq,
                              config.block_size, config.torch_device, prepare_meta, max_drafts)
    prefill = worst_prefill_step(config)

    def run_prefill(out: SchedulerOutput):
        step = inputs.build_prefill(out)
        step.meta.slot_mapping.fill_(-1)  # the stand-in cache has one block: write nothing
        # One sequence a sampled row: a drafted sequence samples at each of its positions.
        run_step(step, [out.seqs[i] for i in step.sample_rows], stand_in.layers)

    def run_decode():
        padding = [Sequence(-1, [0], profile_params(i, graph_batch_size)) for i in range(graph_batch_size)]
        run_step(inputs.build_decode(SchedulerOutput.empty_decode(), pad_to=graph_batch_size), padding,
                 stand_in.layers)

    prefill_peak = _peak_bytes(lambda: run_prefill(prefill))
    if verify is not None:
        prefill_peak = max(prefill_peak, _peak_bytes(lambda: run_prefill(verify)))
    decode_peak = _peak_bytes(run_decode) if graph_batch_size is not None else 0
    return prefill_peak, decode_peak


def _peak_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@torch.inference_mode()
def measure_kv_budget(config: EngineConfig, run_step: RunStep, graph_batch_size: int | None,
                      prepare_meta: PrepareMeta) -> int:
    """Bytes the KV cache may take on this GPU (see the module docstring); 0 when none are left.

    run_step: runs the model on a step's inputs and samples (see RunStep). graph_batch_size: the
    largest decode graph to reserve for, or None when graphs are off. prepare_meta: the attention
    backend's `prepare`.
    """
    device = config.torch_device
    prefill_peak, decode_peak = _activation_peaks(config, run_step, graph_batch_size, prepare_meta)
    torch.cuda.empty_cache()  # the stand-in cache and the profiling builder are gone by now
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    budget = int(total * config.gpu_memory_utilization) - in_use - prefill_peak - decode_peak
    logger.info(
        "GPU memory: total %.2f GiB, in use %.2f GiB, prefill peak %.2f GiB, decode peak %.2f GiB "
        "-> KV budget %.2f GiB",
        *(x / 2**30 for x in (total, in_use, prefill_peak, decode_peak, max(budget, 0))),
    )
    return max(budget, 0)
