"""Speculative decoding's drafter for an engine: prompt lookup, or a draft model with its own
runner and cache (`speculative_config`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastgen.config import EngineConfig
from fastgen.engine.block_manager import BlockManager
from fastgen.sequence import Sequence
from fastgen.speculative.config import SpeculativeConfig
from fastgen.speculative.draft_model import DraftModelProposer
from fastgen.speculative.drafts import ROW_COST, Drafter

if TYPE_CHECKING:
    from fastgen.step_runner import StepRunner


def draft_engine_config(config: EngineConfig, num_blocks: int) -> EngineConfig:
    """The draft model's engine settings: the engine's own (device, dtype, lengths, batch sizes,
    block size, compile mode) over the draft's folder and quantization, with as many cache blocks
    as the engine's, so every sequence the engine holds has room in the draft cache too."""
    spec = config.speculative_config
    return dataclasses.replace(
        config, model=spec["model"], dtype=config.dtype_name, quantization=spec["quantization"],
        quantization_group_size=None, speculative_config=None, num_kv_blocks=num_blocks, kv_cache_memory_bytes=None,
        overlap_scheduling=False, tensor_parallel_size=1)


def weight_bytes(model) -> int:
    """Bytes of a model's parameters and buffers (quantized weights are buffers)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def build_drafter(config: EngineConfig, runner: StepRunner, load_format: str,
                  prediction_of: Callable[[Sequence], list[int] | None]) -> Drafter:
    """The engine's drafter. With a draft model, a drafted token's prior cost (until measured)
    adds the draft model's step, taken as its weights' share of the engine's: at batch 1 both
    stream their weights."""
    spec = SpeculativeConfig.from_dict(config.speculative_config)
    device = config.torch_device.type
    verify_graphs = runner.graphs is not None and bool(runner.graphs.verify_sizes)
    row_cost = ROW_COST["cuda-graphs" if device == "cuda" and verify_graphs else device]
    if spec.method != "draft_model":
        return Drafter(spec, row_cost, prediction_of)
    from fastgen.model_runner import ModelRunner  # torch and the model: not for `import fastgen`

    draft_config = draft_engine_config(config, runner.num_kv_blocks)
    draft_runner = ModelRunner(draft_config, load_format=load_format)
    blocks = BlockManager(draft_runner.num_kv_blocks, config.block_size, enable_prefix_caching=True)
    model = DraftModelProposer(draft_runner, blocks, config.max_num_batched_tokens,
                               draft_config.model_config.vocab_size)
    row_cost += weight_bytes(draft_runner.model) / max(1, weight_bytes(runner.model))
    return Drafter(spec, row_cost, prediction_of, model)
