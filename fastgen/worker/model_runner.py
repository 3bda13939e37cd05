"""Owns the model, the KV cache and the sampler on one device; runs one scheduled step."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fastgen.attention import select_backend
from fastgen.compile import build_op_set
from fastgen.config import LOAD_FORMATS, EngineConfig
from fastgen.distributed.group import SINGLE_RANK, TensorParallelGroup
from fastgen.engine.scheduler import SchedulerOutput
from fastgen.graphs import CudaGraphRunner, default_capture_sizes
from fastgen.models.loader import load_weights
from fastgen.models.registry import model_class
from fastgen.worker.buffers import TokenReadback
from fastgen.worker.kv_cache import KVCache, check_fits_one_sequence, needs_measured_budget, num_blocks_for_budget
from fastgen.worker.memory_profile import measure_kv_budget
from fastgen.worker.sampler import Sampler
from fastgen.worker.step_inputs import StepInputBuilder, StepInputs, StepLayout

logger = logging.getLogger(__name__)


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# The initializers nn.Linear / nn.Embedding / nn.LayerNorm call when built.
_INITIALIZERS = ("kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "uniform_", "normal_",
                 "trunc_normal_", "ones_", "zeros_")


@contextmanager
def skip_weight_init(skip: bool):
    """Build modules without drawing random weights that the checkpoint overwrites anyway (most
    of a small model's build time). The loader refuses a checkpoint that misses a weight, so
    nothing left uninitialized is ever used."""
    if not skip:
        yield
        return
    saved = {name: getattr(torch.nn.init, name) for name in _INITIALIZERS}
    try:
        for name in _INITIALIZERS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


@torch.inference_mode()
def forward_logits(model, inputs: StepInputs, kv_layers: list) -> torch.Tensor:
    """The model over one step's inputs and cache layers; logits of the rows that sample
    (prefill: `meta.logits_indices`; decode: every row, padding included)."""
    hidden = model(inputs.input_ids, inputs.positions, inputs.meta, kv_layers)
    if inputs.meta.logits_indices is not None:
        hidden = hidden.index_select(0, inputs.meta.logits_indices)
    return model.compute_logits(hidden)


@torch.inference_mode()
def profile_step(model, sampler: Sampler, inputs: StepInputs, seqs: list, kv_layers: list) -> None:
    """What the memory profile runs: the forward, the greedy argmax a decode graph holds, and
    sampling every row with the profile's (costliest) settings."""
    logits = forward_logits(model, inputs, kv_layers)
    logits.argmax(dim=-1)
    sampler(logits[: len(seqs)], seqs)


def capture_sizes(config: EngineConfig) -> list[int]:
    """The decode batch sizes that get a CUDA graph (at most max_num_seqs)."""
    sizes = config.cuda_graph_batch_sizes or default_capture_sizes(config.max_num_seqs,
                                                                   config.max_cuda_graph_batch_size)
    return [s for s in sizes if s <= config.max_num_seqs] or [1]


@dataclass(frozen=True)
class LaunchedStep:
    """A step whose GPU work is queued: which scheduled rows sample, and whether their token
    ids are on their way to the host (`ModelRunner.collect` reads them)."""

    num_seqs: int
    sample_rows: list[int]


class ModelRunner:
    """Turns a `SchedulerOutput` into one sampled token per sequence that reached its last token.

    Start-up, in order: build the model, load its weights, measure what the GPU can spare (CUDA),
    size and allocate the KV cache, capture the decode graphs.

    Under tensor parallelism every rank has a ModelRunner over its shard (`tp`); all ranks run
    start-up in step (the budget is the smallest any rank measured, so every cache has the same
    block count). Rank 0's gets a `step_sender` and is driven by the engine: `launch` hands each
    filled step to the other ranks (`make_step_sender(builder).send`) before running it. The others are driven by
    `fastgen.distributed.worker`, which calls `execute` on the steps it receives.
    """

    def __init__(self, config: EngineConfig, load_format: str = "safetensors", tp: TensorParallelGroup = SINGLE_RANK,
                 make_step_sender: Callable[[StepInputBuilder], object] | None = None):
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={load_format!r} must be one of {list(LOAD_FORMATS)}")
        self.config = config
        self.device = config.torch_device  # cpu or cuda:N, resolved by the config
        if self.device.type == "cuda":
            # Triton launches and graph capture use the thread's current device, not the tensors'.
            torch.cuda.set_device(self.device)
        mc = config.model_config
        self.ops = build_op_set(config.compile_enabled)
        self.backend = select_backend(self.device, config.block_size, self.ops, config.attention_backend)

        start = time.perf_counter()
        real_weights = load_format == "safetensors"
        with default_dtype(config.torch_dtype), torch.device(self.device), skip_weight_init(real_weights):
            self.model = model_class(mc.architecture)(mc, self.backend, self.ops, max_positions=config.max_model_len,
                                                      tp=tp)
        if real_weights:
            load_weights(self.model, config.model)
        self.model.eval()
        logger.info("model built in %.1fs (%s, %s)", time.perf_counter() - start, config.torch_dtype, self.device)

        self.inputs = StepInputBuilder(config.max_num_seqs, config.max_num_batched_tokens, config.max_blocks_per_seq,
                                       config.block_size, self.device)
        sizes = capture_sizes(config) if config.graphs_enabled else None
        budget = None
        if needs_measured_budget(config):
            # A sampler of its own: profiling must not advance the engine's generator.
            profiler = Sampler(mc.vocab_size, self.device, 0, self.ops.sample_tokens)
            budget = measure_kv_budget(config, functools.partial(profile_step, self.model, profiler),
                                       max(sizes) if sizes else None)
            budget = tp.min_across_ranks(budget, self.device)
        num_blocks = num_blocks_for_budget(config, budget)
        check_fits_one_sequence(config, num_blocks)
        self.kv_cache = KVCache(config, num_blocks)

        self.sampler = Sampler(mc.vocab_size, self.device, config.seed, self.ops.sample_tokens)
        self.readback = TokenReadback(config.max_num_seqs, self.device)
        self.graphs = CudaGraphRunner(self.model, self.inputs, self.kv_cache.layers, sizes, config.max_model_len,
                                      self.device) if sizes else None
        self.step_sender = make_step_sender(self.inputs) if make_step_sender is not None else None

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def forward_logits(self, inputs: StepInputs) -> torch.Tensor:
        """Logits of the rows that sample, computed eagerly over the engine's cache."""
        return forward_logits(self.model, inputs, self.kv_cache.layers)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> LaunchedStep:
        """Queue one step's GPU work: inputs, forward (graph replay or eager), sampling, and the
        copy of the sampled ids to the host. Returns without waiting for the GPU."""
        self.sampler.release(out.finished_seq_ids)
        layout = self._fill(out)
        if self.step_sender is not None:
            self.step_sender.send(layout, self.inputs)
        logits, greedy = self.execute(layout)
        sample_seqs = [out.seqs[i] for i in layout.sample_rows]
        if sample_seqs:
            n = len(sample_seqs)
            self.readback.start(self.sampler(logits[:n], sample_seqs, None if greedy is None else greedy[:n]))
        return LaunchedStep(len(out.seqs), list(layout.sample_rows))

    def _fill(self, out: SchedulerOutput) -> StepLayout:
        """The step's host rows; a decode batch a graph can run is padded to its size."""
        if out.is_prefill:
            return self.inputs.fill_prefill(out)
        n = len(out.seqs)
        if self.graphs is not None and self.graphs.can_run(n):
            return self.inputs.fill_decode(out, pad_to=self.graphs.padded_size(n))
        return self.inputs.fill_decode(out)

    @torch.inference_mode()
    def execute(self, layout: StepLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Upload a filled step and run the model on it: what every tensor-parallel rank runs.
        Returns the logits of the rows that sample (decode: every row, padding included) and,
        from a decode graph, their argmax (else None)."""
        inputs = self.inputs.upload(layout)
        if not layout.is_prefill and self.graphs is not None and layout.num_rows in self.graphs.sizes:
            return self.graphs.replay(inputs)
        return self.forward_logits(inputs), None

    def collect(self, step: LaunchedStep) -> list[int | None]:
        """Wait for a launched step's tokens: one per scheduled sequence, None where its chunk
        stopped short of its last token."""
        sampled: list[int | None] = [None] * step.num_seqs
        if step.sample_rows:
            for row, token in zip(step.sample_rows, self.readback.wait()):
                sampled[row] = token
        return sampled

    def run(self, out: SchedulerOutput) -> list[int | None]:
        """Run one step and wait for its tokens (`launch` then `collect`)."""
        return self.collect(self.launch(out))

    def shutdown(self) -> None:
        """Nothing to release on one device (a tensor-parallel engine stops its workers here)."""
