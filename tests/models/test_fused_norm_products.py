"""The Llama family's norms taken into the products after them (`RMSNorm.project` over
`fastgen.kernels.normed_skinny_matmul`, what runs on CUDA for decode batches of one or two
rows), run here through Triton's interpreter: the tokens are transformers' greedy ones."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from fastgen import LLM, SamplingParams
from fastgen.layers import quantizable
from tests.conftest import random_prompts

MAX_TOKENS = 8


@pytest.mark.triton
# Qwen3's layer (a per-head q/k norm) in `make test`; test-slow adds Qwen2's (a q|k|v bias, which
# the kernel's own tests add in every tiling) and Llama's.
@pytest.mark.parametrize("family", ["qwen3", pytest.param("qwen2", marks=pytest.mark.slow),
                                    pytest.param("llama", marks=pytest.mark.slow)])
def test_decode_through_the_fused_kernel_equals_transformers(tiny_models, reference, family, monkeypatch):
    """Prompts are prefilled through the ops in turn (many rows), then the two sequences decode
    through the kernel: q|k|v (with Qwen2's bias) and gate|up with SwiGLU, in every layer."""
    kernel = quantizable._normed_skinny_matmul()
    launches = []

    def counted(*args, **kwargs):
        launches.append(args[-1])  # swiglu
        return kernel(*args, **kwargs)

    monkeypatch.setattr(quantizable, "_normed_on_cuda", lambda x, weight: x.numel() <= 2 * x.shape[-1])
    monkeypatch.setattr(quantizable, "_normed_skinny_matmul", lambda: counted)
    model = tiny_models[family]
    prompts = random_prompts([5, 12], seed=3)
    llm = LLM(model, dtype="float32", block_size=16, num_kv_blocks=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outputs] == reference(model, prompts, MAX_TOKENS)
    layers = AutoConfig.from_pretrained(model).num_hidden_layers
    assert launches.count(True) == launches.count(False) >= layers * (MAX_TOKENS - 1)
