"""The CPU steps compiled: the CPU counterpart of the decode CUDA graphs.

Eager decode on a CPU pays Python and dispatch for every op (about 25 a layer), and oneDNN's
bf16 GEMM runs far below the memory bandwidth with one row. Here the step (the forward, the LM
head and the greedy argmax) is torch.compile'd: Inductor's C++ backend fuses the element-wise
work and the KV store into few loops, and its C++ wrapper runs them without Python in between.
The layers are compiled a group at a time (`fastgen.cpu.layer_groups`: one graph of a third of
the layers or fewer, called once per group on that group's weights and caches, then a small
graph for the final norm, LM head and argmax; the embedding runs eagerly before them), which
took a cold compile of SmolLM2-135M from 49-50 s to 19-21 s at the same step speed; a model
whose layers' weights do not lie alike gets the whole step as one graph (`rows`). The same graphs
serve every step, prefill, decode and both at once:

- rows: every new token is a row of the C++ attention kernel
  (`fastgen.cpu.native.decode_attention`) with its sequence's block table and its own length
  (`CausalRows`: a prompt's token at position p attends to the first p + 1 cached tokens, a
  decoding sequence's new token to all of them), and the LM head runs over the sampling rows
  only. The linears are fastgen's GEMM over weights packed once
  (`fastgen.cpu.native.packed_linear`; oneDNN's where the CPU has AMX), called like the kernel
  from the C++ wrapper as an op, and Inductor fuses what lies between them. One decoding row is a
  matrix-vector product, which the packed GEMM streams near the memory's bandwidth: on two cores
  of a Xeon (AVX-512 BF16, no AMX) a batch-1 step of SmolLM2-135M took 12.4 ms where a graph of
  its own, every linear and attention written as Inductor reductions, had taken 17.4-18.3 ms.
  Eager, the element-wise work between the GEMMs (RMSNorm, RoPE, the KV store, SiLU) cost about
  0.25 s of a 1.15 s prefill of 32 prompts (2,853 tokens, SmolLM2-135M, bf16, 2 threads), each
  op a pass over memory. A prefill step that wants prompt logprobs, or of one token, runs
  eagerly.
- decode: where the kernel does not cover the model (a head dim it has no instance for, no
  compiler), decode steps only, attention through torch (`torch_decode`); prefill runs eagerly.

One graph rather than three (a prefill graph, and decode graphs of one row and of many) halved
what a first run compiles: a dummy-weight SmolLM2-135M benchmark with empty caches took 78.6 s
where two graphs, side by side in two processes, took 87.7-92.1 s, at the same step speed. Cut
into groups of layers, the same benchmark took 30-31 s where the one graph took 60 s (another,
faster machine).

Every graph takes the model's weights as one flat buffer per dtype and forms each weight inside
(`fastgen.cpu.flat_weights`), so a call hands over about 70 tensors, not 251: at batch 1 the
Python and handle work around the compiled code went from about 0.5 to 0.2 ms a step.

Shapes are symbolic in the token count, the sampled rows and the longest context, so none grows
into new compiles as the step changes; a graph whose first step has one token is traced from
two copies of it (`traced_example`), so one graph serves one row and many. Nothing is padded:
each step runs exactly its rows, and a step with a slot of -1 runs eagerly, so every slot a graph
stores is a real one (the plan's `every_slot_valid`); only the LM head gets a repeated row when
a step samples fewer than two.

The first use of a graph compiles it (not start-up): about 20 s on two cores for SmolLM2-135M's
group of 10 layers. The compiled graph is saved under fastgen's cache folder
(`fastgen.cpu.saved_graphs`), keyed by everything its trace depends on, so a later process with
the same model and fastgen loads it in a few seconds and neither traces nor compiles.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from fastgen.attention.metadata import AttentionMetadata
from fastgen.attention.torch_paged import CausalRows, TorchStepPlan, plan_of
from fastgen.cpu.background_compile import BackgroundCompile, CompileHelpers
from fastgen.cpu.step_threads import STEP_THREADS
from fastgen.cpu.flat_weights import flatten_weights, weight_views
from fastgen.cpu.layer_groups import GroupedWeights, LayerGroup, StepHead, group_weights, layers_per_group
from fastgen.cpu.native.decode_attention import kernel_built, kernel_supports
from fastgen.cpu.native.packed_linear import linears_as_packed, pack_linear_weights, packable_weights
from fastgen.cpu.native.quantized_linear import pack_quantized_weights, twin_bytes
from fastgen.cpu.native.torch_decode import DecodeKVIndex
from fastgen.cpu.saved_graphs import graph_key, load_or_compile
from fastgen.layers.attention import PagedAttention
from fastgen.paths import cache_dir
from fastgen.worker.memory import check_fits
from fastgen.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)


def inductor_backend(gm: torch.fx.GraphModule, example_inputs):
    """A Dynamo backend: Inductor with its C++ wrapper over the graph, its bf16 linears rewritten
    first into products over packed weights (`linears_as_packed`)."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    linears_as_packed(gm)
    # Precision casts emulated: a fused kernel then rounds each intermediate to bf16 where eager
    # torch (and so transformers) does. The wrapper (the step's op calls and buffers, thousands
    # of lines) is built apart from the kernels, at -O1: at -O3 it was most of the graph's C++
    # compile (18.2 of 28 s for a 30-layer decode graph; at -O1 4.7 s, beside 6.7 s for the
    # kernels at -O3), and the steps ran as fast.
    with config.patch(cpp_wrapper=True, cpp_wrapper_build_separate=True, emulate_precision_casts=True), \
            warnings.catch_warnings():
        # A quantized embedding's lookup reads float16 scales into bf16 rows in one loop:
        # Inductor notes the mix on every compile, and it is what the lookup means.
        warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node")
        return compile_fx(gm, example_inputs)


class StepModel(nn.Module):
    """The model's forward and its LM head as one module, so that one `functional_call` runs
    both on the weights a graph forms from its flat buffers (`fastgen.cpu.flat_weights`)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, meta: AttentionMetadata, layers, logits_indices=None):
        hidden = self.model(input_ids, positions, meta, layers)
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        return self.model.compute_logits(hidden)


def make_rows_step(layout):
    """The rows graph's function, its weights laid out as `layout` says: every new token a row
    of the decode kernel (`CausalRows`); logits [S, vocab] of the rows `logits_indices` picks,
    and their argmax."""

    def rows_step(step_model, weights, input_ids, positions, slot_mapping, row_tables, row_lens, logits_indices,
                     kv_caches):
        plan = TorchStepPlan(causal_rows=CausalRows(row_tables, row_lens), every_slot_valid=True)
        meta = AttentionMetadata(True, slot_mapping, row_tables, row_lens, None, 1, 1, logits_indices,
                                 backend_plan=plan)
        layers = list(zip(kv_caches[0::2], kv_caches[1::2]))
        logits = torch.func.functional_call(step_model, weight_views(weights, layout),
                                            (input_ids, positions, meta, layers, logits_indices))
        return logits, logits.argmax(dim=-1)

    return rows_step


def kernel_runs_prefill(model, kv_caches: list[torch.Tensor]) -> bool:
    """Whether the CPU attention kernel covers this model's prefill, its library built (the
    graph holds no other prefill attention: the per-sequence loop reads host lengths, which a
    graph cannot)."""
    layer = next(m for m in model.modules() if isinstance(m, PagedAttention))
    q = torch.empty(1, layer.num_heads, layer.head_dim, dtype=kv_caches[0].dtype)
    return kernel_supports(q, kv_caches[0], kv_caches[1]) and kernel_built()


def make_decode_step(layout):
    """The decode graph's function, its weights laid out as `layout` says: logits [rows, vocab]
    in the model's dtype and their argmax."""

    def decode_step(step_model, weights, input_ids, positions, slot_mapping, block_tables, context_lens, slots,
                    bias, live, kv_caches):
        plan = TorchStepPlan(decode_kv=DecodeKVIndex(slots, bias, live), every_slot_valid=True)
        meta = AttentionMetadata(False, slot_mapping, block_tables, context_lens, None, 1, slots.shape[1], None,
                                 backend_plan=plan)
        layers = list(zip(kv_caches[0::2], kv_caches[1::2]))
        logits = torch.func.functional_call(step_model, weight_views(weights, layout),
                                            (input_ids, positions, meta, layers))
        return logits, logits.argmax(dim=-1)

    return decode_step


def make_layers_step(layout):
    """A layer group's graph (`fastgen.cpu.layer_groups`): the group's layers over its weights
    (laid out as `layout` says) and caches, every new token a row of the decode kernel, as in
    the rows graph; returns (x, residual) for the next group."""

    def layers_step(group, weights, x, residual, positions, slot_mapping, row_tables, row_lens, kv_caches):
        plan = TorchStepPlan(causal_rows=CausalRows(row_tables, row_lens), every_slot_valid=True)
        meta = AttentionMetadata(True, slot_mapping, row_tables, row_lens, None, 1, 1, None, backend_plan=plan)
        layers = list(zip(kv_caches[0::2], kv_caches[1::2]))
        return torch.func.functional_call(group, weight_views(weights, layout), (positions, x, residual, meta, layers))

    return layers_step


def make_head_step(layout):
    """The step's end after the layer groups: final norm, the rows `logits_indices` picks, their
    logits [S, vocab] and argmax."""

    def head_step(head, weights, x, residual, logits_indices):
        logits = torch.func.functional_call(head, weight_views(weights, layout), (x, residual, logits_indices))
        return logits, logits.argmax(dim=-1)

    return head_step


# Per graph, how many of its last inputs are not one row per token (sampled rows, caches).
_NOT_PER_ROW = {"rows": 2, "decode": 1, "layers": 1, "head": 1}


def traced_example(name: str, args: tuple) -> tuple:
    """The inputs graph `name` is traced from, given its first call's `args` (weights first).
    A step of one token (a decode step of one sequence) is traced as two copies of that token's
    row (never run: tracing reads only shapes and strides), so that the graph's token count is a
    symbol assumed >= 2, as the sampled-row count is, and not the constant 1. Traced from one
    row, a size of 1 would either be specialized (no other batch could run) or, traced
    size-obliviously, leave the strides of views over that dimension arbitrary: a GPT-2 graph
    traced so read the wrong rows of its K/V projections at batch 5. A graph of rows >= 2 runs
    one row as written: each loop over rows runs once, and row 0's offsets do not depend on any
    stride."""
    if args[1].shape[0] != 1:
        return args
    # The sampled rows are two or more already; the caches are what they are.
    end = len(args) - _NOT_PER_ROW[name]
    per_row = args[1:end]
    # The copies are contiguous, so the graph assumes each input is: the step's inputs are.
    assert all(tensor.is_contiguous() for tensor in per_row), "a step's per-row inputs are contiguous"
    return (args[0], *(torch.cat([tensor, tensor]) for tensor in per_row), *args[end:])


class CompiledDecodeStep:
    """model: the decoder; kv_layers: each layer's (k_cache, v_cache), which the step writes
    (`fastgen.worker.kv_cache.KVCache.layers`).

    background: the child process that compiles missing graphs while steps run eagerly
    (`fastgen.cpu.background_compile`); None: a missing graph is compiled here, at its first use,
    while `helpers` (if given) compile the other missing graphs in processes of their own, and
    that first use waits for them.

    `step(inputs)` runs uploaded decode inputs (their metadata prepared by the torch backend)
    and returns the logits of every row and their argmax, or None where that graph is not ready
    (compiling in the background) or could not be built: the caller then runs the step eagerly,
    and a failed build is never tried again."""

    GRAPHS = ("rows", "decode", "layers", "head")

    def __init__(self, model, kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
                 background: BackgroundCompile | None = None, helpers: CompileHelpers | None = None):
        self.model = model
        self.background = background
        self.helpers = helpers
        self.only: set[str] | None = None  # a helper's: the graphs it builds (the others' steps run eagerly)
        self.kv_caches = [cache for layer in kv_layers for cache in layer]
        # The graphs take the weights as one flat buffer per dtype (the model's parameters become
        # views of them), not as hundreds of inputs: see `fastgen.cpu.flat_weights`.
        self.step_model = StepModel(model)
        self.weights = flatten_weights(self.step_model)
        # One cache and one weight layout for the engine's life: their sizes are constants.
        for tensor in (*self.kv_caches, *self.weights.buffers):
            torch._dynamo.mark_static(tensor)
        self.runs_prefill = kernel_runs_prefill(model, self.kv_caches)
        # Where the kernel covers prefill: a group of layers compiled once and called per group,
        # then the head (`fastgen.cpu.layer_groups`); else (layers that cannot be cut alike) the
        # rows graph, the whole step in one graph.
        self.grouped = self._group_layers() if self.runs_prefill else None
        names = {name: name for name in self.GRAPHS}
        if self.grouped is not None:
            self.layer_group = LayerGroup(model.decoder_layers, self.grouped.size)
            self.step_head = StepHead(model)
            names["layers"] = f"layers of {self.grouped.size}"
            per_group = 2 * self.grouped.size  # each layer's K and V cache
            self.group_caches = [self.kv_caches[g * per_group:(g + 1) * per_group]
                                 for g in range(len(self.grouped.groups))]
            for group in self.grouped.groups:
                for tensor in group:
                    torch._dynamo.mark_static(tensor)
        keys = {name: graph_key(key_name, model, model.config, self.kv_caches) for name, key_name in names.items()}
        self.paths = {name: cache_dir() / "compiled" / f"decode-{key}.pt" for name, key in keys.items()}
        self.packed_weights = 0  # packed at the first use of a graph that reads them (`_pack_weights`)
        self._packing_tried = False
        self._graphs: dict[str, Callable] = {}
        self.first_call_seconds: dict[str, float] = {}  # graph name -> load or compile, plus first run
        self.loaded: set[str] = set()  # the graphs read from disk rather than compiled
        self.failed: set[str] = set()  # the graphs whose build raised: eager decode instead
        self.background_seconds: dict[str, float] = {}  # graph name -> from the child's start to its load
        # The graphs this engine's steps use: where the kernel covers the model's prefill, for
        # every step (decode steps too: `_decode_as_rows`) the layer group's and the head's (or
        # the rows graph); else a decode graph.
        self.needed = (("layers", "head") if self.grouped is not None else ("rows",)) if self.runs_prefill \
            else ("decode",)
        self._awaited = {name for name in self.needed if not self.paths[name].exists()}  # what the child builds
        if background is not None and self._awaited:
            background.start()  # now, not at the first step: the sooner it starts, the sooner it ends
        # Whether the child ran as this step began (`_leave_the_child_a_core`): one answer a step.
        self.child_running = False

    def before_step(self) -> None:
        """The threads every CPU step of this engine runs with, compiled or eager (a step that
        wants prompt logprobs runs eagerly without `step`): a thread fewer while the background
        child runs, every thread otherwise."""
        if self.background is not None:
            self._leave_the_child_a_core()
        else:
            STEP_THREADS.settle()

    @torch.inference_mode()
    def step(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        self.before_step()
        meta = inputs.meta
        if meta.is_prefill:
            return self._prefill(inputs)
        if self.runs_prefill:
            return self._decode_as_rows(inputs)
        index = plan_of(meta).decode_kv
        args = (inputs.input_ids, inputs.positions, meta.slot_mapping, meta.block_tables, meta.context_lens,
                index.slots, index.bias, index.live, self.kv_caches)
        return self._run("decode", args)

    def _prefill(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Logits and argmax of a prefill step's sampling rows, or None where the step runs
        eagerly: a prompt step of one token (as ever; a decode step of one row runs the graph),
        attention the kernel does not cover, or a token whose K/V must not be stored (slot -1: a
        prompt whose blocks are all prefix-cached recomputes its last token). The graph's store
        has no -1 filter (a data-dependent shape), and -1 would index the cache's last slot."""
        meta = inputs.meta
        if not self.runs_prefill or inputs.input_ids.shape[0] < 2 or bool((meta.slot_mapping < 0).any()):
            return None
        rows = plan_of(meta).causal_rows
        assert rows is not None, "the kernel covers this model's prefill, so the torch backend planned its rows"
        return self._run_rows(inputs, rows.block_tables, rows.context_lens, meta.logits_indices)

    def _decode_as_rows(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step through the rows graph: each sequence's new token is a row of the
        attention kernel with its sequence's block table and length, as a prompt's tokens are
        (`CausalRows`), and every row is sampled."""
        meta = inputs.meta
        tables = meta.block_tables.to(torch.int32).contiguous()
        lens = meta.context_lens.to(torch.int32).contiguous()
        return self._run_rows(inputs, tables, lens, torch.arange(inputs.input_ids.shape[0]))

    def _run_rows(self, inputs: StepInputs, row_tables: torch.Tensor, row_lens: torch.Tensor,
                  picked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows graph over `inputs`, its rows' tables and lengths, sampling the rows `picked`:
        their logits and argmax, or None where the graph is not ready. The sampled-row count is
        a symbol >= 2 too: a step sampling fewer rows repeats row 0 and drops the extra logits."""
        num_sampled = picked.shape[0]
        if num_sampled < 2:
            picked = torch.cat([picked, picked.new_zeros(2 - num_sampled)])
        if self.grouped is not None:
            out = self._run_grouped(inputs, row_tables, row_lens, picked)
        else:
            out = self._run("rows", (inputs.input_ids, inputs.positions, inputs.meta.slot_mapping, row_tables,
                                     row_lens, picked, self.kv_caches))
        if out is None:
            return None
        logits, greedy = out
        return logits[:num_sampled], greedy[:num_sampled]

    def _group_layers(self) -> GroupedWeights | None:
        """The layers' weights cut into groups, or None where the model does not say what its
        layers are or their weights do not lie alike."""
        layers = getattr(self.model, "decoder_layers", None)
        if layers is None:
            return None
        prefix = next(name for name, module in self.step_model.named_modules() if module is layers)
        size = layers_per_group(len(layers), self.model.uniform_layers())
        return group_weights(self.weights, prefix, len(layers), size)

    def _run_grouped(self, inputs: StepInputs, row_tables: torch.Tensor, row_lens: torch.Tensor,
                     picked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step as the embedding (eager), the layer group's graph once per group, and the
        head's graph: the logits and argmax of the rows `picked`, or None where a graph is not
        ready or failed (the step then runs eagerly)."""
        grouped, caches = self.grouped, self.group_caches
        # A helper that builds only the head's graph gets no layers graph here, and needs none.
        helping = self.only is not None and "layers" not in self.only
        if not helping and "layers" not in self._graphs and ("layers" in self.failed
                                                              or not self._ready_to_build("layers")):
            return None  # before the embedding: an eager step embeds its tokens itself
        positions, slots = inputs.positions, inputs.meta.slot_mapping
        x, residual = self.model.embed(inputs.input_ids, positions)
        layers = self._graph("layers", self.layer_group, (grouped.groups[0], x, residual, positions, slots,
                                                           row_tables, row_lens, caches[0]))
        first_run = not {"layers", "head"} <= self._graphs.keys()  # both run together from the first
        head = (self._graph("head", self.step_head, (self.weights.buffers, x, residual, picked))
                if layers is not None or helping else None)
        if layers is None or head is None:
            return None
        start = time.perf_counter()
        try:
            for weights, group_caches in zip(grouped.groups, caches):
                x, residual = layers(self.layer_group, weights, x, residual, positions, slots, row_tables, row_lens,
                                     group_caches)
            layers_done = time.perf_counter()
            out = head(self.step_head, self.weights.buffers, x, residual, picked)
        except Exception:
            if not first_run:
                raise
            self._drop_failed_at_first_run(self.needed)
            return None
        if first_run:  # as for the rows graph: load or compile, plus the first run
            self.first_call_seconds["layers"] += layers_done - start
            self.first_call_seconds["head"] += time.perf_counter() - layers_done
        return out

    def _drop_failed_at_first_run(self, names: tuple[str, ...]) -> None:
        """Graphs that built but raised at their first run: logged once, forgotten, never tried
        again, as a build that fails (a graph that raised part-way may have stored some of this
        step's K/V; the eager forward the caller runs stores them again)."""
        logger.exception("the CPU step graphs %s failed at their first run; running those steps eagerly",
                         " and ".join(names))
        for name in names:
            self._graphs.pop(name, None)
            self.first_call_seconds.pop(name, None)
            self.loaded.discard(name)
        self.failed.update(names)

    def _graph(self, name: str, module: torch.nn.Module, args: tuple) -> Callable | None:
        """Graph `name` over `module`, loaded or compiled at its first use (args: an example of its
        inputs), or None where it is not ready (compiling in the background) or failed."""
        graph = self._graphs.get(name)
        if graph is not None or name in self.failed or not self._ready_to_build(name):
            return graph
        if self.helpers is not None and not self.helpers.started and self.only is None \
                and not self.paths[name].exists():  # (a graph on disk loads in seconds: no helper then)
            self.helpers.start([other for other in self.needed if other != name and not self.paths[other].exists()])
        self._pack_weights()
        # Each graph is symbolic in every size that changes (decode rows >= 1, prefill tokens
        # >= 2, contexts >= 2: a decode row attends to its prompt and its new token), so it is
        # built once.
        factory = {"rows": lambda: make_rows_step(self.weights.slots),
                   "decode": lambda: make_decode_step(self.weights.slots),
                   "layers": lambda: make_layers_step(self.grouped.layout),
                   "head": lambda: make_head_step(self.grouped.head_slots)}[name]
        start = time.perf_counter()
        try:
            with STEP_THREADS.all_threads():  # another engine's child may still run
                graph, loaded = load_or_compile(factory(), inductor_backend, traced_example(name, args), module,
                                                self.paths[name])
        except Exception:  # a compiler bug or a missing C++ toolchain must not stop serving
            logger.exception("could not build the CPU step graph %s; running those steps eagerly", name)
            self.failed.add(name)
            self._await_helpers()
            return None
        self._graphs[name] = graph
        self.first_call_seconds[name] = time.perf_counter() - start
        self._await_helpers()
        if loaded:
            self.loaded.add(name)
        logger.info("%s the CPU step graph %s in %.1fs (%s)%s", "loaded" if loaded else "compiled",
                    name, self.first_call_seconds[name], self.paths[name],
                    f", {self.background_seconds[name]:.0f}s after the background compile started"
                    if name in self.background_seconds else "")
        return graph

    def _ready_to_build(self, name: str) -> bool:
        """Whether this process should load or compile graph `name` now: always without a
        background compile; with one, only once the child has ended and the graph's file is in
        the cache. Not while the child runs: a compiled graph's parallel regions take a thread a
        core (the count is compiled in), and the child's compiler would take a core from them at
        every region (`fastgen.cpu.step_threads`), while eager steps leave it one. Never
        compiled here in background mode (minutes of work in the serving process): a child that
        ended without the file leaves that graph's steps eager, with a warning."""
        if self.only is not None and name not in self.only:
            return False
        if self.background is None:
            return True
        if self.child_running:
            return False
        if self.paths[name].exists():
            if name in self._awaited and name not in self.background_seconds:
                self.background_seconds[name] = self.background.seconds
            return True
        self.background.start()
        if (code := self.background.exit_code()) is not None and not self.background.stopped:
            logger.warning("the background compile ended (%s) without the graph %s; its steps run eagerly",
                           self.background.describe_exit(code), name)
            self.failed.add(name)
        return False

    def _leave_the_child_a_core(self) -> None:
        """A thread fewer for this step (and the eager forward that may follow it) while the
        background child runs (`fastgen.cpu.step_threads`); the count from before once it has
        ended. The child is asked once a step, so that the graphs load only in a step that has
        every thread."""
        self.child_running = self.background.running
        STEP_THREADS.update(self, self.child_running, still_compiling=lambda child=self.background: child.running)

    def close(self) -> None:
        """Stop a background compile or helpers that still run, and give the steps back the
        thread they lent it (in the closing thread; a thread that stepped settles at its next
        step)."""
        if self.background is not None:
            self.background.stop()
            STEP_THREADS.update(self, False)
        if self.helpers is not None:
            self.helpers.stop()

    def _pack_weights(self) -> None:
        """Pack the weights for the graphs' GEMMs, once, where the copies fit in memory (else
        those GEMMs reorder the plain weights on every call, and quantized products of many
        rows run the GEMV)."""
        if self._packing_tried:
            return
        self._packing_tried = True
        needed = sum(weight.numel() * weight.element_size() for weight in packable_weights(self.model))
        needed += twin_bytes(self.model)
        try:
            check_fits("packed copies of the linear weights (the compiled CPU steps' GEMMs)", needed,
                       torch.device("cpu"), "those GEMMs use the plain weights instead")
            self.packed_weights = pack_linear_weights(self.model) + pack_quantized_weights(self.model)
        except (ValueError, RuntimeError) as exc:  # short of memory, or a kernel refused to pack
            logger.warning("not packing the linear weights: %s", exc)

    def _run(self, name: str, args: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole step in one graph (`rows` or `decode`) over args (weights first added here):
        the logits and argmax, or None where the graph is not ready or failed."""
        args = (self.weights.buffers, *args)
        first_run = name not in self._graphs
        graph = self._graph(name, self.step_model, args)
        if graph is None:
            return None
        if not first_run:
            return graph(self.step_model, *args)
        start = time.perf_counter()
        try:
            out = graph(self.step_model, *args)
        except Exception:
            self._drop_failed_at_first_run((name,))
            return None
        self.first_call_seconds[name] += time.perf_counter() - start  # load or compile, plus the first run
        return out

    def _await_helpers(self) -> None:
        """Wait for the helpers still compiling (blocking mode: every graph ready after this step)."""
        if self.helpers is not None and self.helpers.children:
            self.helpers.wait()
            logger.info("waited %.1fs for the helper processes (%s)", self.helpers.wait_seconds,
                        ", ".join(f"{graph} {seconds:.0f}s" for graph, seconds in self.helpers.seconds.items()))
