"""Decode through CUDA graphs: captured once per padded batch size, replayed every step.

Each graph reads the step-input builder's persistent device buffers (input ids, positions,
slot mapping, context lengths, block tables) — the same tensors every step, refilled in place —
and writes its hidden states to an output owned by that graph. The block-table buffer is
max_blocks_per_seq wide, enough for a max_model_len sequence, so no validated request can
outgrow it. A batch of n runs in the graph of the next captured size; the builder fills the
padding rows with slot -1 (the KV store skips them), context length 0 (attention reads nothing)
and -1 block tables, and the outputs are sliced back to n.

`capture=False` runs the very same pad-copy-slice path eagerly: that is how CPU tests check it.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time

import torch

from fastgen.graphs.batch_sizes import padded_size
from fastgen.engine.scheduler import SchedulerOutput
from fastgen.worker.step_inputs import StepInputBuilder, StepInputs

logger = logging.getLogger(__name__)


class CudaGraphRunner:
    """model: the decoder; inputs: the step-input builder whose buffers the graphs read;
    kv_layers: the per-layer cache views every forward gets; sizes: batch sizes to capture;
    max_model_len: the widest context a graph must serve."""

    def __init__(self, model, inputs: StepInputBuilder, kv_layers: list, sizes: list[int], max_model_len: int,
                 device: torch.device, capture: bool = True):
        self.model = model
        self.inputs = inputs
        self.kv_layers = kv_layers
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.device = device
        self.capture_enabled = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0
        if capture:
            self._capture_all()

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def can_run(self, n: int) -> bool:
        return n <= self.max_size

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_layers)

    def _padding_inputs(self, size: int) -> StepInputs:
        """Inputs for `size` rows that are all padding (what capture records)."""
        empty = SchedulerOutput.empty_decode()
        inputs = self.inputs.build_decode(empty, pad_to=size)
        # A graph serves every later context length: record the widest one.
        meta = dataclasses.replace(inputs.meta, max_context_len=self.max_model_len)
        return dataclasses.replace(inputs, meta=meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        device = self.device
        torch.cuda.synchronize(device)
        free_before, _ = torch.cuda.mem_get_info(device)
        start = time.perf_counter()
        pool = None
        # Objects collected mid-capture could free tensors the graph still refers to, and a
        # collection pause inside capture is wasted time: freeze what exists, collect nothing.
        gc.collect()
        gc.freeze()
        try:
            for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
                inputs = self._padding_inputs(size)
                self._forward(inputs)  # warm-up (compile, autotune)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self._forward(inputs)
                pool = graph.pool()
                self.graphs[size], self.hidden[size] = graph, hidden
        finally:
            gc.unfreeze()
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - start
        free_after, _ = torch.cuda.mem_get_info(device)
        self.graph_memory_bytes = max(0, free_before - free_after)
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.2fs using %.1f MiB",
            len(self.sizes), self.sizes, self.capture_seconds, self.graph_memory_bytes / 2**20,
        )

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> tuple[StepInputs, torch.Tensor]:
        """Decode `out` (n <= max_size sequences); return its inputs and logits [n, vocab]."""
        n = len(out.seqs)
        size = padded_size(n, self.sizes)
        inputs = self.inputs.build_decode(out, pad_to=size)
        if self.capture_enabled:
            self.graphs[size].replay()
            hidden = self.hidden[size]
        else:
            hidden = self._forward(inputs)
        return inputs, self.model.compute_logits(hidden[:n])
