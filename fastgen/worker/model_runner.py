"""Owns the model, the KV cache and the sampler on one device; runs one scheduled step."""

from __future__ import annotations

import functools
import logging
import time
from contextlib import contextmanager

import torch

from fastgen.attention import select_backend
from fastgen.compile import build_op_set
from fastgen.config import LOAD_FORMATS, EngineConfig
from fastgen.engine.scheduler import SchedulerOutput
from fastgen.graphs import CudaGraphRunner, default_capture_sizes
from fastgen.models.loader import load_weights
from fastgen.models.registry import model_class
from fastgen.worker.kv_cache import (
    KVCache, check_fits_one_sequence, measure_kv_budget, needs_measured_budget, num_blocks_for_budget,
)
from fastgen.worker.memory import check_kv_cache_fits, check_model_fits, check_step_inputs_fit
from fastgen.worker.sampler import Sampler
from fastgen.worker.step_inputs import StepInputBuilder, StepInputs

logger = logging.getLogger(__name__)


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@torch.inference_mode()
def forward_logits(model, inputs: StepInputs, kv_layers: list) -> torch.Tensor:
    """The model over one step's inputs and cache layers; logits of the rows that sample."""
    hidden = model(inputs.input_ids, inputs.positions, inputs.meta, kv_layers)
    return model.compute_logits(hidden.index_select(0, inputs.meta.logits_indices))


def capture_sizes(config: EngineConfig) -> list[int]:
    """The decode batch sizes that get a CUDA graph (at most max_num_seqs)."""
    sizes = config.cuda_graph_batch_sizes or default_capture_sizes(config.max_num_seqs,
                                                                   config.max_cuda_graph_batch_size)
    return [s for s in sizes if s <= config.max_num_seqs] or [1]


class ModelRunner:
    """Turns a `SchedulerOutput` into one sampled token per sequence that reached its last token.

    Start-up, in order: build the model, load its weights, measure what the GPU can spare (CUDA),
    size and allocate the KV cache, capture the decode graphs.
    """

    def __init__(self, config: EngineConfig, load_format: str = "safetensors"):
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={load_format!r} must be one of {list(LOAD_FORMATS)}")
        self.config = config
        self.device = config.torch_device
        if self.device.type == "cuda":
            # Triton launches and graph capture use the thread's current device, not the tensors'.
            torch.cuda.set_device(self.device)
        mc = config.model_config
        self.ops = build_op_set(config.compile_enabled)
        self.backend = select_backend(self.device, config.block_size)

        check_model_fits(config)
        start = time.perf_counter()
        with default_dtype(config.torch_dtype), torch.device(self.device):
            self.model = model_class(mc.architecture)(mc, self.backend, self.ops, max_positions=config.max_model_len)
        if load_format == "safetensors":
            load_weights(self.model, config.model)
        self.model.eval()
        logger.info("model built in %.1fs (%s, %s)", time.perf_counter() - start, config.torch_dtype, self.device)

        check_step_inputs_fit(config)
        self.inputs = StepInputBuilder(config.max_num_seqs, config.max_num_batched_tokens, config.max_blocks_per_seq,
                                       config.block_size, self.device)
        sizes = capture_sizes(config) if config.graphs_enabled else None
        budget = None
        if needs_measured_budget(config):
            budget = measure_kv_budget(config, functools.partial(forward_logits, self.model),
                                       max(sizes) if sizes else None)
        num_blocks = num_blocks_for_budget(config, budget)
        check_fits_one_sequence(config, num_blocks)
        check_kv_cache_fits(config, num_blocks)
        self.kv_cache = KVCache(config, num_blocks)

        self.sampler = Sampler(mc.vocab_size, self.device, config.seed, self.ops.sample_tokens)
        self.graphs = CudaGraphRunner(self.model, self.inputs, self.kv_cache.layers, sizes, config.max_model_len,
                                      self.device) if sizes else None

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def forward_logits(self, inputs: StepInputs) -> torch.Tensor:
        """Logits of the rows that sample, computed eagerly over the engine's cache."""
        return forward_logits(self.model, inputs, self.kv_cache.layers)

    def forget(self, preempted_seq_ids, finished_seq_ids) -> None:
        """Follow facts no step carried (the scheduler went idle after them): drop those
        sequences' block-table rows, and the finished ones' sampling generators."""
        for seq_id in (*preempted_seq_ids, *finished_seq_ids):
            self.inputs.block_table.forget(seq_id)
        self.sampler.release(finished_seq_ids)

    def recover(self, out: SchedulerOutput | None) -> None:
        """After `run(out)` raised (or a step failed before reaching it, out None): the step may
        have stopped anywhere, so trust no block-table row (every sequence's is written afresh
        when it next runs) and follow the step's facts."""
        self.inputs.block_table.forget_all()
        if out is not None:
            self.sampler.release(out.finished_seq_ids)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> list[int | None]:
        """Run one step; return the sampled token of each scheduled sequence (None where the
        sequence's chunk stopped short of its last token)."""
        self.sampler.release(out.finished_seq_ids)
        if out.is_prefill:
            inputs = self.inputs.build_prefill(out)
            logits = self.forward_logits(inputs)
        elif self.graphs is not None and self.graphs.can_run(len(out.seqs)):
            inputs, logits = self.graphs.run(out)
        else:
            inputs = self.inputs.build_decode(out)
            logits = self.forward_logits(inputs)
        sample_seqs = [out.seqs[i] for i in inputs.sample_rows]
        sampled: list[int | None] = [None] * len(out.seqs)
        if sample_seqs:
            tokens = self.sampler(logits[: len(sample_seqs)], sample_seqs).tolist()
            for row, token in zip(inputs.sample_rows, tokens):
                sampled[row] = token
        return sampled
