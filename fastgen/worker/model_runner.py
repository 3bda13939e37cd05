"""Owns the model, the KV cache and the sampler on one device; runs one scheduled step."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from fastgen.attention import select_backend
from fastgen.compile import build_op_set
from fastgen.config import LOAD_FORMATS, EngineConfig
from fastgen.engine.scheduler import SchedulerOutput
from fastgen.graphs import CudaGraphRunner, default_capture_sizes
from fastgen.models.loader import load_weights
from fastgen.models.registry import model_class
from fastgen.worker.buffers import TokenReadback
from fastgen.worker.kv_cache import KVCache, check_fits_one_sequence, needs_measured_budget, num_blocks_for_budget
from fastgen.worker.logprobs import TopLogprobs, prompt_logprobs, sampled_logprobs
from fastgen.worker.memory import check_kv_cache_fits, check_model_fits, check_step_inputs_fit
from fastgen.worker.memory_profile import measure_kv_budget
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
def forward_hidden(model, inputs: StepInputs, kv_layers: list) -> torch.Tensor:
    """The model over one step's inputs and cache layers; hidden states [tokens, hidden]."""
    return model(inputs.input_ids, inputs.positions, inputs.meta, kv_layers)


@torch.inference_mode()
def forward_logits(model, inputs: StepInputs, kv_layers: list) -> torch.Tensor:
    """The model over one step's inputs and cache layers; logits of the rows that sample
    (prefill: `meta.logits_indices`; decode: every row, padding included)."""
    hidden = forward_hidden(model, inputs, kv_layers)
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


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What one step produced.

    sampled: the token of each sequence of the step (None where its chunk stopped short of its
    last token), then of each forked child (`SchedulerOutput.forked_seqs`). logprobs: aligned
    with `sampled`, for the tokens of requests that asked for logprobs (None elsewhere); None
    when none did. prompt_logprobs: seq_id -> (first prompt position covered, its logprobs).
    """

    sampled: list[int | None]
    logprobs: list[TopLogprobs | None] | None = None
    prompt_logprobs: dict[int, tuple[int, list[TopLogprobs]]] = field(default_factory=dict)


def capture_sizes(config: EngineConfig) -> list[int]:
    """The decode batch sizes that get a CUDA graph (at most max_num_seqs)."""
    sizes = config.cuda_graph_batch_sizes or default_capture_sizes(config.max_num_seqs,
                                                                   config.max_cuda_graph_batch_size)
    return [s for s in sizes if s <= config.max_num_seqs] or [1]


@dataclass(frozen=True)
class LaunchedStep:
    """A step whose GPU work is queued; `ModelRunner.collect` reads its tokens.

    num_rows: sequences of the step plus its forked children. rows: which of them sampled, in
    the sampler's order (their ids are on their way to the host). logits / tokens /
    sample_seqs: what the sampler got and gave, for the logprobs read at collect time.
    """

    num_rows: int
    rows: list[int]
    prompt_logprobs: dict
    logits: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    sample_seqs: list = field(default_factory=list)


class ModelRunner:
    """Turns a `SchedulerOutput` into one sampled token per sequence that reached its last token.

    Start-up, in order: build the model, load its weights, measure what the GPU can spare (CUDA),
    size and allocate the KV cache, capture the decode graphs.
    """

    def __init__(self, config: EngineConfig, load_format: str = "safetensors", eos_token_ids: Iterable[int] = ()):
        """eos_token_ids: the tokens that end generation (min_tokens bans them until then)."""
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

        check_model_fits(config)
        start = time.perf_counter()
        real_weights = load_format == "safetensors"
        with default_dtype(config.torch_dtype), torch.device(self.device), skip_weight_init(real_weights):
            self.model = model_class(mc.architecture)(mc, self.backend, self.ops, max_positions=config.max_model_len)
        if real_weights:
            load_weights(self.model, config.model)
        self.model.eval()
        logger.info("model built in %.1fs (%s, %s)", time.perf_counter() - start, config.torch_dtype, self.device)

        check_step_inputs_fit(config)
        self.inputs = StepInputBuilder(config.max_num_seqs, config.max_num_batched_tokens, config.max_blocks_per_seq,
                                       config.block_size, self.device)
        sizes = capture_sizes(config) if config.graphs_enabled else None
        budget = None
        if needs_measured_budget(config):
            # A sampler of its own: profiling must not advance the engine's generator.
            profiler = Sampler(mc.vocab_size, self.device, 0, self.ops.sample_tokens)
            budget = measure_kv_budget(config, functools.partial(profile_step, self.model, profiler),
                                       max(sizes) if sizes else None)
        num_blocks = num_blocks_for_budget(config, budget)
        check_fits_one_sequence(config, num_blocks)
        check_kv_cache_fits(config, num_blocks)
        self.kv_cache = KVCache(config, num_blocks)

        self.sampler = Sampler(mc.vocab_size, self.device, config.seed, self.ops.sample_tokens,
                               penalty_fn=self.ops.apply_penalties, eos_token_ids=eos_token_ids)
        self.readback = TokenReadback(config.max_num_seqs, self.device)
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
        self.sampler.release_token_counts(preempted_seq_ids)

    def recover(self, out: SchedulerOutput | None) -> None:
        """After `run(out)` raised (or a step failed before reaching it, out None): the step may
        have stopped anywhere, so trust no block-table row (every sequence's is written afresh
        when it next runs) and follow the step's facts."""
        self.inputs.block_table.forget_all()
        self.readback.discard()  # a launch that got as far as the copy left its tokens unread
        if out is not None:
            self.sampler.release(out.finished_seq_ids)
            self.sampler.release_token_counts(out.preempted_seq_ids)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> LaunchedStep:
        """Queue one step's GPU work: inputs, the forward (graph replay or eager), the block copies
        of its forks, one sampler call for every row that samples (forked children sample from
        their parent's logits) and the copy of the sampled ids to the host. Returns without
        waiting for the GPU."""
        self.sampler.release(out.finished_seq_ids)
        self.sampler.release_token_counts(out.preempted_seq_ids)
        prompt_lps = {}
        greedy = None
        if out.is_prefill:
            inputs = self.inputs.build_prefill(out)
            if any(seq.params.prompt_logprobs is not None for seq in out.seqs):  # every position's logits
                hidden = forward_hidden(self.model, inputs, self.kv_cache.layers)
                logits = self.model.compute_logits(hidden.index_select(0, inputs.meta.logits_indices))
                prompt_lps = prompt_logprobs(out, hidden, self.model.compute_logits)
            else:
                logits = self.forward_logits(inputs)
        elif self.graphs is not None and self.graphs.can_run(len(out.seqs)):
            inputs, logits, greedy = self.graphs.run(out)
        else:
            inputs = self.inputs.build_decode(out)
            logits = self.forward_logits(inputs)
        rows = list(inputs.sample_rows)
        logits = logits[: len(rows)]
        if out.forks:
            logits = self._fork(out, rows, logits)
            rows += range(len(out.seqs), len(out.seqs) + len(out.forked_seqs))
            greedy = None  # the graph's argmax covers the parents' rows only
        sample_seqs = [*(out.seqs[i] for i in inputs.sample_rows), *out.forked_seqs]
        num_rows = len(out.seqs) + len(out.forked_seqs)
        if not sample_seqs:
            return LaunchedStep(num_rows, [], prompt_lps)
        tokens = self.sampler(logits, sample_seqs, None if greedy is None else greedy[: len(rows)])
        self.readback.start(tokens)
        return LaunchedStep(num_rows, rows, prompt_lps, logits, tokens, sample_seqs)

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step's tokens (and the logprobs of the requests that asked)."""
        sampled: list[int | None] = [None] * step.num_rows
        if not step.rows:
            return ModelRunnerOutput(sampled, None, step.prompt_logprobs)
        top = sampled_logprobs(step.logits, step.sample_seqs, step.tokens)
        logprobs = None if top is None else [None] * len(sampled)
        for k, (row, token) in enumerate(zip(step.rows, self.readback.wait())):
            sampled[row] = token
            if top is not None:
                logprobs[row] = top[k]
        return ModelRunnerOutput(sampled, logprobs, step.prompt_logprobs)

    def run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its tokens (`launch` then `collect`)."""
        return self.collect(self.launch(out))

    def _fork(self, out: SchedulerOutput, rows: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Copy the forks' blocks (the forward has written the parents' last blocks) and append
        each child's row: its parent's logits."""
        copies = [copy for fork in out.forks for copy in fork.block_copies]
        if copies:
            self.kv_cache.copy_blocks(copies)
        place = {row: k for k, row in enumerate(rows)}
        parents = [place[fork.parent_index] for fork in out.forks for _ in fork.children]
        index = torch.tensor(parents, dtype=torch.int64).to(logits.device, non_blocking=True)
        return torch.cat([logits, logits.index_select(0, index)])
