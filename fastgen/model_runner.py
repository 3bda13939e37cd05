"""Owns the model, the KV cache and the sampler on one device; runs one scheduled step."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from fastgen.attention import select_backend
from fastgen.compile import build_ops
from fastgen.config import EngineConfig
from fastgen.graphs import CudaGraphRunner, default_capture_sizes
from fastgen.kv_cache import allocate_kv_cache, check_fits_one_sequence, num_blocks_for_budget
from fastgen.memory_profile import profile_kv_budget
from fastgen.models import DecoderForCausalLM, load_weights
from fastgen.sampler import Sampler
from fastgen.scheduler import SchedulerOutput
from fastgen.step_inputs import StepInputBuilder, StepInputs

logger = logging.getLogger(__name__)


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class ModelRunner:
    """Builds the model (real or random weights), sizes and binds the KV cache, and turns a
    `SchedulerOutput` into one sampled token per sequence that reached its last token."""

    def __init__(self, config: EngineConfig, load_format: str = "safetensors"):
        self.config = config
        self.device = config.torch_device
        if self.device.type == "cuda":
            # Triton launches and graph capture use the thread's current device, not the tensors'.
            torch.cuda.set_device(self.device)
        mc = config.model_config
        self.ops = build_ops(config.compile_enabled)
        self.backend = select_backend(self.device, config.block_size)
        start = time.perf_counter()
        with default_dtype(config.torch_dtype), torch.device(self.device):
            self.model = DecoderForCausalLM(mc, self.backend, self.ops, max_positions=config.max_model_len)
        if load_format == "safetensors":
            load_weights(self.model, config.model)
        elif load_format != "dummy":
            raise ValueError(f"load_format={load_format!r} must be 'safetensors' or 'dummy'")
        self.model.eval()
        logger.info("model built in %.1fs (%s, %s)", time.perf_counter() - start, config.torch_dtype, self.device)

        self.inputs = StepInputBuilder(
            config.max_num_seqs, config.max_num_batched_tokens, config.max_blocks_per_seq,
            config.block_size, self.device,
        )
        self.num_kv_blocks = num_blocks_for_budget(config, self._gpu_kv_budget())
        check_fits_one_sequence(config, self.num_kv_blocks)
        self.kv_cache = allocate_kv_cache(config, self.num_kv_blocks)
        self.bind_kv_cache(self.kv_cache)
        self.sampler = Sampler(mc.vocab_size, self.device, config.seed, self.ops.sample_tokens)
        self.graphs = CudaGraphRunner(self, self.capture_sizes) if config.graphs_enabled else None

    @property
    def capture_sizes(self) -> list[int]:
        config = self.config
        sizes = config.cuda_graph_batch_sizes or default_capture_sizes(
            config.max_num_seqs, config.max_cuda_graph_batch_size
        )
        return [s for s in sizes if s <= config.max_num_seqs] or [1]

    def _gpu_kv_budget(self) -> int | None:
        """On CUDA: what gpu_memory_utilization leaves after weights, a peak-sized step and the
        decode graphs; None elsewhere (the CPU budget comes from the config)."""
        if self.device.type != "cuda" or self.config.kv_cache_memory_bytes or self.config.num_kv_blocks:
            return None
        return profile_kv_budget(self)

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        """Give each attention layer its [2, ...] slice of a cache tensor."""
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = cache[0, i], cache[1, i]

    @torch.inference_mode()
    def forward_logits(self, inputs: StepInputs) -> torch.Tensor:
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model.compute_logits(hidden.index_select(0, inputs.meta.logits_indices))

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> list[int | None]:
        """Run one step; return the sampled token of each scheduled sequence (None where the
        sequence's chunk stopped short of its last token)."""
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
