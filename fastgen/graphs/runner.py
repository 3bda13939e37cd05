"""Decode through CUDA graphs: captured once per padded batch size, replayed every step.

Each graph reads the step-input builder's persistent device buffers (input ids, positions,
slot mapping, context lengths, block tables) — the same tensors every step, refilled in place —
and runs the whole decode step on the device: the forward, the LM head, and the greedy argmax,
into outputs owned by that graph. A greedy batch needs nothing after the replay but the copy of
its token ids; a sampled batch reads the graph's logits. The block-table buffer is
max_blocks_per_seq wide, enough for a max_model_len sequence, so no validated request can
outgrow it. A batch of n runs in the graph of the next captured size; the builder fills the
padding rows with slot -1 (the KV store skips them), context length 0 (attention reads nothing)
and -1 block tables, and the outputs are sliced back to n.

Start-up first warms every size up eagerly (Triton JIT, torch.compile, cuBLAS heuristics:
`warmup_seconds`), then captures them all (`capture_seconds`), so each number means one thing.

`capture=False` runs the very same pad-copy-slice path eagerly: that is how CPU tests check it.

Speculative decoding's verify steps get graphs too (`verify_rows_per_seq`, 1 + the draft
length): such a step is laid out as decode rows, one a token (`StepInputBuilder.fill_verify`),
each row with its own context length and its sequence's block-table row, so a graph of R rows
serves any verify step of up to R tokens. Those graphs store every row's K/V before any row
attends (rows of one sequence read each other's), which the decode graphs fold into one launch.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time

import torch

from fastgen.graphs.batch_sizes import padded_size
from fastgen.models import one_launch_layer
from fastgen.scheduler_output import SchedulerOutput
from fastgen.worker.step_inputs import StepInputBuilder, StepInputs

logger = logging.getLogger(__name__)

# A switch so that benchmarks can compare verify steps replayed from graphs with eager ones
# (`benchmarks/gpu_speculative.py --verify-graphs off`); read when a runner is built.
CAPTURE_VERIFY_STEPS = True


class CudaGraphRunner:
    """model: the decoder; inputs: the step-input builder whose buffers the graphs read;
    kv_layers: the per-layer cache views every forward gets; sizes: batch sizes to capture;
    max_model_len: the widest context a graph must serve."""

    def __init__(self, model, inputs: StepInputBuilder, kv_layers: list, sizes: list[int], max_model_len: int,
                 device: torch.device, capture: bool = True, verify_rows_per_seq: int = 0):
        self.model = model
        self.inputs = inputs
        self.kv_layers = kv_layers
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.device = device
        self.capture_enabled = capture
        self.verify_sizes = verify_sizes(self.sizes, verify_rows_per_seq if CAPTURE_VERIFY_STEPS else 0,
                                         inputs.max_verify_rows)
        # (rows, is a verify step) -> graph, and its outputs: (logits, greedy ids)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        # The shape the last replay ran and its inputs' upload number (`last_replayed_shape`).
        self._last_replay: tuple[tuple[int, bool], int] | None = None
        self.warmup_seconds = 0.0
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0
        if capture:
            self._capture_all()

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def can_run(self, n: int) -> bool:
        return n <= self.max_size

    def _decode(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """What a graph holds: logits [rows, vocab] in the model's dtype and their argmax [rows]."""
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_layers)
        logits = self.model.compute_logits(hidden)
        return logits, logits.argmax(dim=-1)

    def _padding_inputs(self, size: int, verify: bool) -> StepInputs:
        """Inputs for `size` rows that are all padding (what capture records)."""
        empty = SchedulerOutput.empty_decode()
        fill = self.inputs.fill_verify if verify else self.inputs.fill_decode
        inputs = self.inputs.upload(fill(empty, pad_to=size))
        # A graph serves every later context length: record the widest one.
        meta = dataclasses.replace(inputs.meta, max_context_len=self.max_model_len)
        return dataclasses.replace(inputs, meta=meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        device = self.device
        shapes = sorted([(size, False) for size in self.sizes] + [(size, True) for size in self.verify_sizes])
        # Each shape's padding rows are uploaded right before that shape runs: with packed
        # uploads every layout's inputs share one device buffer, so an earlier upload of another
        # shape is overwritten (capture only needs the addresses, which depend on the shape).
        start = time.perf_counter()
        for shape in reversed(shapes):  # compile, autotune and JIT every shape outside capture
            self._decode(self._padding_inputs(*shape))
        torch.cuda.synchronize(device)
        one_launch_layer.raise_if_stalled(self.model)  # a fault of those kernels, before any graph holds it
        self.warmup_seconds = time.perf_counter() - start
        free_before, _ = torch.cuda.mem_get_info(device)
        start = time.perf_counter()
        pool = None
        # Objects collected mid-capture could free tensors the graph still refers to, and a
        # collection pause inside capture is wasted time: freeze what exists, collect nothing.
        gc.collect()
        gc.freeze()
        try:
            for shape in reversed(shapes):  # largest first: smaller graphs reuse its pool
                inputs = self._padding_inputs(*shape)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[shape] = self._decode(inputs)
                pool = graph.pool()
                self.graphs[shape] = graph
        finally:
            gc.unfreeze()
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - start
        free_after, _ = torch.cuda.mem_get_info(device)
        self.graph_memory_bytes = max(0, free_before - free_after)
        logger.info(
            "decode CUDA graphs for batch sizes %s (verify steps of %s rows): warm-up %.2fs, capture %.2fs, %.1f MiB",
            self.sizes, self.verify_sizes, self.warmup_seconds, self.capture_seconds, self.graph_memory_bytes / 2**20,
        )

    def padded_size(self, n: int) -> int:
        """The captured batch size a batch of n (<= max_size) runs in."""
        return padded_size(n, self.sizes)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> tuple[StepInputs, torch.Tensor, torch.Tensor]:
        """Decode `out` (n <= max_size sequences); return its inputs, logits [n, vocab] and
        greedy token ids [n] (int64, on the device)."""
        n = len(out.seqs)
        inputs = self.inputs.build_decode(out, pad_to=self.padded_size(n))
        logits, greedy = self.replay(inputs)
        return inputs, logits[:n], greedy[:n]

    def verify_size(self, rows: int) -> int | None:
        """The captured verify-step size a verify step of `rows` rows runs in (None: none fits)."""
        return next((size for size in self.verify_sizes if size >= rows), None)

    def can_replay(self, rows: int, verify: bool) -> bool:
        return rows in (self.verify_sizes if verify else self.sizes)

    @torch.inference_mode()
    def replay(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Run uploaded decode (or verify, `StepInputBuilder.fill_verify`) inputs whose row count
        is a captured size; logits and greedy ids of every row, padding included (the graph's
        own output tensors)."""
        shape = (inputs.input_ids.shape[0], inputs.meta.several_rows_a_sequence)
        self._last_replay = (shape, inputs.upload)
        if self.capture_enabled:
            self.graphs[shape].replay()
            return self.outputs[shape]
        return self._decode(inputs)

    def last_replayed_shape(self) -> tuple[int, bool] | None:
        """The (rows, verify) shape of the last replayed step while its inputs are the last ones
        uploaded, so that its graph reads them (what a benchmark may replay again by itself, on
        one rank: under tensor parallelism a graph's collectives need every rank); else None. A
        graph reads its inputs at fixed addresses: replayed after another step's upload it reads
        that step's rows, and with packed uploads another layout's bytes (block ids from the
        wrong piece: an illegal memory access)."""
        if self._last_replay is None:
            return None
        shape, uploads = self._last_replay
        return shape if uploads == self.inputs.uploads else None


def verify_sizes(sizes: list[int], rows_per_seq: int, max_rows: int) -> list[int]:
    """Row counts of the verify-step graphs: each decode size, and each times `rows_per_seq`
    (a batch whose every sequence has a full draft), up to the largest decode size (its
    activations are what the memory budget was measured with; one sequence's full draft always
    fits, a few rows' more) and the builder's rows."""
    if rows_per_seq <= 1 or not max_rows:
        return []
    limit = min(max(max(sizes), rows_per_seq), max_rows)
    # A verify step has a draft token, so two rows at least.
    return sorted({r for size in sizes for r in (size, size * rows_per_seq) if 2 <= r <= limit})
