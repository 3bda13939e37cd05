"""Owns the model, the KV cache and the sampler on one device; runs one scheduled step."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from fastgen.attention import select_backend
from fastgen.compile import build_op_set
from fastgen.config import LOAD_FORMATS, EngineConfig
from fastgen.cpu.allocator import keep_freed_memory
from fastgen.graphs import CudaGraphRunner, default_capture_sizes
from fastgen.models.build import default_dtype, skip_weight_init
from fastgen.models.loader import load_weights
from fastgen.models.quantize import quantize_model
from fastgen.models.registry import model_class
from fastgen.parallel.group import SINGLE_RANK, TensorParallelGroup
from fastgen.scheduler_output import SchedulerOutput
from fastgen.speculative.verify import accepted_prefix
from fastgen.step_runner import ModelRunnerOutput
from fastgen.worker.buffers import TokenReadback
from fastgen.worker.kv_cache import (
    KVCache,
    check_fits_one_sequence,
    needs_measured_budget,
    num_blocks_for_budget,
    share_with_draft_model,
)
from fastgen.worker.memory import check_kv_cache_fits, check_model_fits, check_step_inputs_fit
from fastgen.worker.memory_profile import measure_kv_budget
from fastgen.worker.sampler import Sampler
from fastgen.worker.step_clock import StepClock
from fastgen.worker.step_inputs import StepInputBuilder, StepInputs, StepLayout
from fastgen.worker.top_logprobs import SampledLogprobs, add_prompt_logprobs, prompt_logprob_chunks, sampled_logprobs

logger = logging.getLogger(__name__)


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


def capture_sizes(config: EngineConfig) -> list[int]:
    """The decode batch sizes that get a CUDA graph (at most max_num_seqs)."""
    sizes = config.cuda_graph_batch_sizes or default_capture_sizes(config.max_num_seqs,
                                                                   config.max_cuda_graph_batch_size)
    return [s for s in sizes if s <= config.max_num_seqs] or [1]


@dataclass(frozen=True)
class LaunchedStep:
    """A step whose GPU work is queued; `ModelRunner.collect` reads its tokens.

    num_rows: sequences of the step plus its forked children. rows: which of them sampled, in
    the sampler's order (their ids are on their way to the host through `readback`; a sequence
    with draft tokens once per position it verifies). logprobs: those of the sampled tokens,
    computed on the device, read at collect time. drafts: the step's draft tokens by sequence.
    """

    num_rows: int
    rows: list[int]
    prompt_logprobs: dict
    readback: TokenReadback | None = None
    logprobs: SampledLogprobs | None = None
    drafts: tuple[tuple[int, ...], ...] = ()


class ModelRunner:  # implements fastgen.step_runner.StepRunner
    """Turns a `SchedulerOutput` into one sampled token per sequence that reached its last token.

    Start-up, in order: build the model, load its weights, measure what the GPU can spare (CUDA),
    size and allocate the KV cache, capture the decode graphs.

    Under tensor parallelism every rank has a ModelRunner over its shard (`tp`); all ranks run
    start-up in step (the budget is the smallest any rank measured, so every cache has the same
    block count). Rank 0's gets a `step_sender` and is driven by the engine: `launch` hands each
    filled step to the other ranks (`make_step_sender(builder).send`) before running it. The
    others are driven by `fastgen.distributed.worker`, which calls `execute` on the steps it
    receives.
    """

    steps_span_processes = False  # rank 0's under tensor parallelism is driven by TensorParallelRunner

    def __init__(self, config: EngineConfig, load_format: str = "safetensors", eos_token_ids: Iterable[int] = (),
                 tp: TensorParallelGroup = SINGLE_RANK,
                 make_step_sender: Callable[[StepInputBuilder], object] | None = None):
        """eos_token_ids: the tokens that end generation (min_tokens bans them until then)."""
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={load_format!r} must be one of {list(LOAD_FORMATS)}")
        self.config = config
        self.device = config.torch_device  # cpu or cuda:N, resolved by the config
        if self.device.type == "cuda":
            # Triton launches and graph capture use the thread's current device, not the tensors'.
            torch.cuda.set_device(self.device)
        else:
            keep_freed_memory()  # before the first step's activations come and go
        mc = config.model_config
        self.ops = build_op_set(config.compile_enabled)
        self.backend = select_backend(self.device, config.block_size, self.ops, config.attention_backend)

        check_model_fits(config)
        start = time.perf_counter()
        real_weights = load_format == "safetensors"
        with default_dtype(config.torch_dtype), torch.device(self.device), skip_weight_init(real_weights):
            self.model = model_class(mc.architecture)(mc, self.backend, self.ops, max_positions=config.max_model_len,
                                                      tp=tp)
        if real_weights:
            load_weights(self.model, config.model)
        if config.quantization is not None:
            quantize_model(self.model, config.quantization, config.quantization_group_size, config.gguf_file)
        self.model.eval()
        logger.info("model built in %.1fs (%s, %s)", time.perf_counter() - start, config.torch_dtype, self.device)

        check_step_inputs_fit(config)
        max_drafts = config.speculative_config["num_speculative_tokens"] if config.speculative_config else 0
        self.inputs = StepInputBuilder(config.max_num_seqs, config.max_num_batched_tokens, config.max_blocks_per_seq,
                                       config.block_size, self.device, self.backend.prepare, max_drafts)
        sizes = capture_sizes(config) if config.graphs_enabled else None
        budget = None
        if needs_measured_budget(config):
            # A sampler of its own: profiling must not advance the engine's generator.
            profiler = Sampler(mc.vocab_size, self.device, 0, self.ops.sample_tokens)
            budget = measure_kv_budget(config, functools.partial(profile_step, self.model, profiler),
                                       max(sizes) if sizes else None, self.backend.prepare)
            budget = tp.min_across_ranks(share_with_draft_model(config, budget), self.device)
        num_blocks = num_blocks_for_budget(config, budget)
        check_fits_one_sequence(config, num_blocks)
        check_kv_cache_fits(config, num_blocks)
        self.kv_cache = KVCache(config, num_blocks)

        self.sampler = Sampler(mc.vocab_size, self.device, config.seed, self.ops.sample_tokens,
                               penalty_fn=self.ops.apply_penalties, eos_token_ids=eos_token_ids)
        # Two: with overlap scheduling a step's tokens are read after the next step launched.
        self.readbacks = [TokenReadback(config.max_num_seqs * (1 + max_drafts), self.device) for _ in range(2)]
        # The last launched step's sampled ids (on the device) and each sampling sequence's row in
        # them: where the next step's pending input ids come from (overlap scheduling).
        self.last_sampled: tuple[torch.Tensor, dict[int, int]] | None = None
        self.step_clock: StepClock | None = None  # set by whoever measures (the benchmarks)
        # Verify steps get graphs of their own on one rank (other ranks receive steps in the
        # layouts `distributed.step_protocol` carries: decode and prefill).
        verify_rows = 1 + max_drafts if tp.size == 1 else 0
        self.graphs = CudaGraphRunner(self.model, self.inputs, self.kv_cache.layers, sizes, config.max_model_len,
                                      self.device, verify_rows_per_seq=verify_rows) if sizes else None
        self.compiled_decode = None
        if config.compiled_decode_enabled:  # CPU only: CUDA runs never load the CPU fast path
            from fastgen.cpu.background_compile import CompileHelpers, background_compile
            from fastgen.cpu.compiled_decode import CompiledDecodeStep

            background = helpers = None
            if config.compile_mode == "background":
                background = background_compile(config, num_blocks)
            elif config.compile_processes != 1:
                helpers = CompileHelpers(lambda graphs: background_compile(config, num_blocks, graphs),
                                         config.compile_processes)
            self.compiled_decode = CompiledDecodeStep(self.model, self.kv_cache.layers, background, helpers)
        self.step_sender = make_step_sender(self.inputs) if make_step_sender is not None else None
        self.in_collectives = False  # inside a step's broadcast and forward (tensor parallelism)

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
        for readback in self.readbacks:
            readback.discard()  # a launch that got as far as the copy left its tokens unread
        self.last_sampled = None
        if out is not None:
            self.sampler.release(out.finished_seq_ids)
            self.sampler.release_token_counts(out.preempted_seq_ids)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> LaunchedStep:
        """Queue one step's GPU work: inputs, the forward (graph replay or eager), the block copies
        of its forks, one sampler call for every row that samples (forked children sample from
        their parent's logits) and the copy of the sampled ids to the host. Returns without
        waiting for the GPU.

        Overlap scheduling: the previous step may not be collected yet; a sequence whose last
        token it sampled gets that token as input on the device (`StepLayout.pending_rows`)."""
        self.in_collectives = False
        self.sampler.release(out.finished_seq_ids)
        self.sampler.release_token_counts(out.preempted_seq_ids)
        chunks = prompt_logprob_chunks(out)
        copies = tuple(copy for fork in out.forks for copy in fork.block_copies)
        layout = self._fill(out)
        if copies or chunks:
            layout = replace(layout, block_copies=copies, logit_spans=tuple(chunk.rows for chunk in chunks))
        if self.step_sender is not None:
            # From the broadcast until the forward returns, every rank must see the step through:
            # a failure in between leaves the ranks out of step (see TensorParallelRunner).
            self.in_collectives = True
            self.step_sender.send(layout, self.inputs)
        prompt_lps: dict = {}
        on_span = functools.partial(add_prompt_logprobs, prompt_lps, chunks) if chunks else None
        if self.step_clock is not None:
            self.step_clock.begin()
        logits, greedy = self.execute(layout, on_span, self._feed_pending)
        self.in_collectives = False
        rows = list(layout.sample_rows)
        logits = logits[: len(rows)]
        if out.forks:
            logits = self._with_fork_rows(out, rows, logits)
            rows += range(len(out.seqs), len(out.seqs) + len(out.forked_seqs))
            greedy = None  # the graph's argmax covers the parents' rows only
        sample_seqs = [*(out.seqs[i] for i in layout.sample_rows), *out.forked_seqs]
        num_rows = len(out.seqs) + len(out.forked_seqs)
        if not sample_seqs:
            self.last_sampled = None
            if self.step_clock is not None:
                self.step_clock.end()
            return LaunchedStep(num_rows, [], prompt_lps)
        offsets = None
        if out.draft_tokens:  # a drafted sequence's rows sample its next positions, one a row
            offsets = [0] * len(layout.sample_rows)
            counts: dict[int, int] = {}
            for k, i in enumerate(layout.sample_rows):
                offsets[k] = counts.get(i, 0)
                counts[i] = offsets[k] + 1
            offsets += [0] * len(out.forked_seqs)
        drafted = {"offsets": offsets} if offsets is not None else {}
        tokens = self.sampler(logits, sample_seqs, None if greedy is None else greedy[: len(rows)], out.grammar,
                              **drafted)
        self.last_sampled = (tokens, {seq.seq_id: k for k, seq in enumerate(sample_seqs)})
        logprobs = sampled_logprobs(logits, sample_seqs, tokens)
        readback = self.readbacks[0] if self.readbacks[0].pending == 0 else self.readbacks[1]
        readback.start(tokens)
        if self.step_clock is not None:
            self.step_clock.end()
        return LaunchedStep(num_rows, rows, prompt_lps, readback, logprobs, out.draft_tokens)

    def _feed_pending(self, layout: StepLayout, inputs: StepInputs) -> None:
        """Write the input ids the previous step sampled and the host has not read (overlap
        scheduling) into the uploaded rows, on the device."""
        if not layout.pending_rows:
            return
        assert self.last_sampled is not None, "a pending input id without a launched step that samples it"
        tokens, row_of = self.last_sampled
        rows = tuple(row_of[seq_id] for seq_id in layout.pending_seq_ids)
        first = layout.pending_rows[0]
        if rows == tuple(layout.pending_rows) == tuple(range(first, first + len(rows))):
            # The steady decode batch: row i takes the token row i sampled, one device copy (no
            # index tensors to upload).
            inputs.input_ids[first:first + len(rows)].copy_(tokens[first:first + len(rows)])
            return
        src = torch.tensor(rows, dtype=torch.int64)
        dst = torch.tensor(layout.pending_rows, dtype=torch.int64)
        inputs.input_ids.index_copy_(0, dst.to(self.device, non_blocking=True),
                                     tokens.index_select(0, src.to(self.device, non_blocking=True)))

    def _fill(self, out: SchedulerOutput) -> StepLayout:
        """The step's host rows; a decode batch a graph can run is padded to its size, and so is
        a verify step (drafts) that a verify graph can run, laid out as decode rows."""
        if out.is_prefill:
            if self.graphs is not None and self.graphs.verify_sizes and self.inputs.can_fill_verify(out):
                size = self.graphs.verify_size(out.num_tokens)
                if size is not None:
                    return self.inputs.fill_verify(out, pad_to=size)
            return self.inputs.fill_prefill(out)
        n = len(out.seqs)
        if self.graphs is not None and self.graphs.can_run(n):
            return self.inputs.fill_decode(out, pad_to=self.graphs.padded_size(n))
        return self.inputs.fill_decode(out)

    @torch.inference_mode()
    def execute(self, layout: StepLayout, on_span_logits: Callable[[int, torch.Tensor], None] | None = None,
                feed_pending: Callable[[StepLayout, StepInputs], None] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Upload a filled step, run the model on it and copy its forks' blocks: what every
        tensor-parallel rank runs. Returns the logits of the rows that sample (decode: every row,
        padding included) and, from a CUDA graph or a compiled CPU graph, their argmax (else None). The logits of
        each of `layout.logit_spans` (hidden rows [a, b), prompt logprobs) are formed one span at
        a time and handed to `on_span_logits(span index, logits)`. feed_pending(layout, inputs)
        writes the input ids that are on the device only (rank 0's, overlap scheduling)."""
        inputs = self.inputs.upload(layout)
        if feed_pending is not None:
            feed_pending(layout, inputs)
        greedy = None
        decode = not layout.is_prefill
        # The compiled CPU graphs form the sampling rows' logits only, so a step that wants
        # other rows' logits (prompt logprobs) runs eagerly.
        compiled_cpu = self.compiled_decode is not None and not layout.logit_spans
        if self.compiled_decode is not None and not compiled_cpu:
            self.compiled_decode.before_step()  # its threads, as a compiled step's
        if decode and self.graphs is not None and self.graphs.can_replay(layout.num_rows,
                                                                         layout.several_rows_a_sequence):
            logits, greedy = self.graphs.replay(inputs)
        elif compiled_cpu and (compiled := self.compiled_decode.step(inputs)) is not None:
            logits, greedy = compiled  # (None: that graph could not be built; the eager forward below)
        elif layout.logit_spans:
            hidden = forward_hidden(self.model, inputs, self.kv_cache.layers)
            logits = self.model.compute_logits(hidden.index_select(0, inputs.meta.logits_indices))
            for i, (a, b) in enumerate(layout.logit_spans):
                span_logits = self.model.compute_logits(hidden[a:b])
                if on_span_logits is not None:
                    on_span_logits(i, span_logits)
        else:
            logits = self.forward_logits(inputs)
        if layout.block_copies:  # after the forward: it writes the parents' last blocks
            self.kv_cache.copy_blocks(list(layout.block_copies))
        return logits, greedy

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step's tokens (and the logprobs of the requests that asked)."""
        sampled: list[int | None] = [None] * step.num_rows
        if not step.rows:
            return ModelRunnerOutput(sampled, None, step.prompt_logprobs)
        tokens = step.readback.wait()
        top = None if step.logprobs is None else step.logprobs.to_host()
        logprobs = None if top is None else [None] * len(sampled)
        verified: dict[int, list[int]] = {}  # drafted sequence -> its samples, position by position
        drafts = step.drafts
        for k, (row, token) in enumerate(zip(step.rows, tokens)):
            if row < len(drafts) and drafts[row]:
                verified.setdefault(row, []).append(token)
                continue
            sampled[row] = token
            if top is not None:
                logprobs[row] = top[k]
        num_accepted = None
        if verified:
            num_accepted = [0] * step.num_rows
            for row, samples in verified.items():
                num_accepted[row] = accepted_prefix(drafts[row], samples)
                sampled[row] = samples[num_accepted[row]]
        return ModelRunnerOutput(sampled, logprobs, step.prompt_logprobs, num_accepted)

    def run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its tokens (`launch` then `collect`)."""
        return self.collect(self.launch(out))

    def shutdown(self) -> None:
        """Stop a background compile (a tensor-parallel engine stops its workers here)."""
        if self.compiled_decode is not None:
            self.compiled_decode.close()

    def check_alive(self) -> None:
        """One device: alive while the process is."""

    def _with_fork_rows(self, out: SchedulerOutput, rows: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Append each forked child's row: its parent's logits at the parent's first sampled row
        (the prompt's last token; a parent whose last prompt token ran as a decode with drafts
        samples more rows after it)."""
        place: dict[int, int] = {}
        for k, row in enumerate(rows):
            place.setdefault(row, k)
        parents = [place[fork.parent_index] for fork in out.forks for _ in fork.children]
        index = torch.tensor(parents, dtype=torch.int64).to(logits.device, non_blocking=True)
        return torch.cat([logits, logits.index_select(0, index)])
