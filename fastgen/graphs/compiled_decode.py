"""The CPU decode step compiled whole: the CPU counterpart of the decode CUDA graphs.

Eager decode on a CPU pays Python and dispatch for every op (about 25 a layer), and oneDNN's
bf16 GEMM runs far below the memory bandwidth with one row. Here the whole step (the forward,
the LM head and the greedy argmax) is one torch.compile'd function: Inductor's C++ backend fuses
the element-wise work, the KV store and the attention into few loops, and its C++ wrapper runs
them without Python in between. Two graphs serve every batch:

- one row: every linear layer is rewritten into a multiply and a row sum (`fastgen.compile.gemv`)
  and attention into broadcast products and sums, so nearly the whole layer becomes Inductor
  reductions that stream the weights at the memory bandwidth;
- two rows or more: the linears stay GEMMs (oneDNN), attention stays two `bmm`s a layer, and
  Inductor fuses what lies between them.

Shapes are symbolic in the batch and in the longest context L, so neither grows into new
compiles as the step changes. Nothing is padded: each step runs exactly its rows, so every
slot it stores is a real one (see `store_kvcache_torch`).

The first use of each graph compiles it (not start-up): one to three minutes on two cores.
Inductor keeps the result in its on-disk cache ($TORCHINDUCTOR_CACHE_DIR, by default under
fastgen's cache folder), so a later process traces the step again (about 20 seconds) but
compiles nothing. That is why one-shot commands (`fastgen generate`) run eagerly by default.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from fastgen.attention.metadata import AttentionMetadata
from fastgen.attention.torch_decode import DecodeKVIndex
from fastgen.compile.gemv import linears_as_gemv
from fastgen.models.default_model import cache_dir
from fastgen.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)


def inductor_backend(gemv: bool):
    """A Dynamo backend: Inductor with its C++ wrapper over the graph, its linears rewritten
    into GEMV reductions first when `gemv`."""

    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx

        if gemv:
            linears_as_gemv(gm)
        # Precision casts emulated in the GEMM graph: a fused kernel then rounds each
        # intermediate to bf16 where eager torch (and so transformers) does. The GEMV graph
        # goes without: emulation there stopped the reductions streaming (30 ms a step, not 10).
        with config.patch(cpp_wrapper=True, emulate_precision_casts=not gemv):
            return compile_fx(gm, example_inputs)

    return compile_graph


class CompiledDecodeStep:
    """model: the decoder; kv_layers: each layer's (k_cache, v_cache), which the step writes
    (`fastgen.worker.kv_cache.KVCache.layers`).

    `step(inputs)` runs uploaded decode inputs (their metadata prepared by the torch backend)
    and returns the logits of every row and their argmax."""

    def __init__(self, model, kv_layers: list[tuple[torch.Tensor, torch.Tensor]]):
        # Inductor's default, a folder under /tmp, is often wiped at boot; keep compiled steps
        # with fastgen's other cached artefacts unless the user chose a place.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
        self.model = model
        self.kv_caches = [cache for layer in kv_layers for cache in layer]
        for cache in self.kv_caches:
            torch._dynamo.mark_static(cache)
        self._one_row = torch.compile(self._forward_one_row, backend=inductor_backend(gemv=True), dynamic=True,
                                      fullgraph=True)
        self._many_rows = torch.compile(self._forward_many_rows, backend=inductor_backend(gemv=False), dynamic=True,
                                        fullgraph=True)
        self.first_call_seconds: dict[str, float] = {}  # "one_row" / "many_rows" -> compile + first run

    @torch.inference_mode()
    def step(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        meta = inputs.meta
        index = meta.decode_kv
        assert index is not None, "decode metadata must pass through the torch backend's prepare()"
        args = (inputs.input_ids, inputs.positions, meta.slot_mapping, meta.block_tables, meta.context_lens,
                index.slots, index.bias, index.live, self.kv_caches)
        name, graph = ("one_row", self._one_row) if inputs.input_ids.shape[0] == 1 else ("many_rows", self._many_rows)
        if name in self.first_call_seconds:
            # Each function has one compiled graph, symbolic in every size that changes (rows
            # >= 2 or exactly 1, contexts >= 2: a decode row attends to its prompt and its new
            # token), and it always gets the same model, caches and dtypes: its guards can only
            # pass, and checking them (hundreds of tensors) cost about 1 ms a step.
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return graph(*args)
        logger.info("compiling the CPU decode step for %s (first use; cached in %s)", name.replace("_", " "),
                    os.environ["TORCHINDUCTOR_CACHE_DIR"])
        start = time.perf_counter()
        out = graph(*args)
        self.first_call_seconds[name] = time.perf_counter() - start
        logger.info("compiled the CPU decode step for %s in %.1fs", name.replace("_", " "),
                    self.first_call_seconds[name])
        return out

    # Two entry points with the same body: Dynamo keeps compiled graphs per code object, so each
    # graph (and its backend) needs a function of its own, or the two would share one cache.
    def _forward_one_row(self, *args):
        return self._forward(*args)

    def _forward_many_rows(self, *args):
        return self._forward(*args)

    def _forward(self, input_ids, positions, slot_mapping, block_tables, context_lens, slots, bias, live, kv_caches):
        """What each graph holds: logits [rows, vocab] in the model's dtype and their argmax."""
        index = DecodeKVIndex(slots, bias, live)
        meta = AttentionMetadata(False, slot_mapping, block_tables, context_lens, None, 1, slots.shape[1], None,
                                 decode_kv=index)
        layers = list(zip(kv_caches[0::2], kv_caches[1::2]))
        hidden = self.model(input_ids, positions, meta, layers)
        logits = self.model.compute_logits(hidden)
        return logits, logits.argmax(dim=-1)
