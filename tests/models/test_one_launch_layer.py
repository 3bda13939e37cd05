"""Decode steps of one or two rows with each layer in one launch (`fastgen.models.one_launch_layer`,
`kernels/decode_layer.py`) give transformers' greedy tokens: run end to end on CPU under the
Triton interpreter (the switch turned on for CPU tensors), compiled on a GPU by `make gpu-test`."""

from __future__ import annotations

import os

import pytest
import torch

from fastgen import LLM, SamplingParams
from fastgen.graphs import CudaGraphRunner
from fastgen.kernels import decode_layer as decode_layer_module
from fastgen.models import one_launch_layer
from tests.conftest import random_prompts

pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def one_launch_layers(monkeypatch):
    """The switch on, on this machine's device, and a count of the launches."""
    launches = []
    kernel_call = decode_layer_module.decode_layer

    def counted(x, residual, weights, *args, **kwargs):
        launches.append((x.shape[0], weights.next_qkv is not None))
        return kernel_call(x, residual, weights, *args, **kwargs)

    monkeypatch.setattr(one_launch_layer, "ONE_LAUNCH_LAYERS_ON_CUDA", True)
    monkeypatch.setattr(one_launch_layer, "ONE_LAUNCH_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(decode_layer_module, "decode_layer", counted)
    return launches


GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="the L2 prefetch is PTX")


# Qwen3 (a per-head q/k norm) and Qwen2 (a q|k|v bias) take the kernel's two switches. On a
# GPU the graphs are captured too, as the engine runs them: each layer's launch then keeps the
# counter set it was captured with, its programs wait in PTX, and steps replay back to back.
@pytest.mark.parametrize("graphs", ["eager", pytest.param("captured", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="captures CUDA graphs"))])
# With the weights of the products after attention and the next layer's q|k|v asked into the L2
# (on a GPU only: under the interpreter those programs only take tickets, which the kernel's own
# tests cover), and with two persistent programs an SM taking ticket after ticket (on a CPU the
# interpreter's first program takes them all).
# Off by default (measured slower than six launches): under the interpreter, only test-slow runs
# it; `make gpu-test` runs it compiled.
@pytest.mark.parametrize("family,l2_prefetch,persistent_per_sm", [
    pytest.param("qwen3", 0, 0, marks=pytest.mark.slow),
    pytest.param("qwen3", 4, 0, marks=GPU_ONLY),
    pytest.param("qwen3", 0, 2, marks=pytest.mark.slow),
    pytest.param("qwen3", 4, 2, marks=GPU_ONLY),
    pytest.param("qwen2", 0, 0, marks=pytest.mark.slow),
    pytest.param("qwen2", 4, 0, marks=[pytest.mark.slow, GPU_ONLY]),
])
def test_decode_in_one_launch_a_layer_matches_transformers(tiny_models, reference, one_launch_layers, family,
                                                          graphs, l2_prefetch, persistent_per_sm, monkeypatch):
    monkeypatch.setattr(decode_layer_module, "L2_PREFETCH_PRODUCTS", l2_prefetch)
    monkeypatch.setattr(decode_layer_module, "PERSISTENT_PROGRAMS_PER_SM", persistent_per_sm)
    model = tiny_models[family]
    prompts = random_prompts([4, 150], seed=31)  # the long one attends over several splits
    llm = LLM(model, dtype="float32", attention_backend="triton", block_size=16, num_kv_blocks=64, max_num_seqs=2,
              max_num_batched_tokens=64)
    runner = llm.engine.runner
    # The decode path a CUDA graph replays (rows padded to 2), eagerly or captured.
    runner.graphs = CudaGraphRunner(runner.model, runner.inputs, runner.kv_cache.layers, [1, 2],
                                    llm.config.max_model_len, runner.device, capture=graphs == "captured")
    outputs = llm.generate(prompts, GREEDY)
    layers = llm.engine.runner.model.config.num_layers
    assert one_launch_layers and len(one_launch_layers) % layers == 0
    rows = {r for r, _ in one_launch_layers}
    assert rows <= {1, 2} and 2 in rows
    # Every layer but the last is handed the next layer's q|k|v, to ask the L2 for.
    steps = len(one_launch_layers) // layers
    assert [has_next for _, has_next in one_launch_layers] == ([True] * (layers - 1) + [False]) * steps
    one_launch_layer.raise_if_stalled(runner.model)  # no wait of any launch gave up
    assert [o.token_ids for o in outputs] == reference(model, prompts, GREEDY.max_tokens)
