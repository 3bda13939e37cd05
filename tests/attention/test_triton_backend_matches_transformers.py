"""The whole CUDA attention path — fused q/k-norm + RoPE + KV store, paged prefill over cached
history, split-KV decode, decode padded to graph sizes — run end to end on CPU under the Triton
interpreter, and its greedy tokens equal transformers' on every model family."""

from __future__ import annotations

import os

import pytest
import torch

from fastgen import LLM, SamplingParams
from fastgen.graphs import CudaGraphRunner
from tests.conftest import FAMILIES, random_prompts

pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def triton_llm(model: str, **kwargs) -> LLM:
    llm = LLM(model, dtype="float32", attention_backend="triton", **kwargs)
    assert llm.engine.runner.backend.name == "triton"
    return llm


# Qwen3 (q/k norm: every piece of the fused kernel) stays in the fast suite; ~8 s a family.
@pytest.mark.parametrize("family", [f if f == "qwen3" else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_chunked_prefill_prefix_hits_and_padded_decode_match_transformers(tiny_models, reference, family):
    model = tiny_models[family]
    system = random_prompts([40], seed=21)[0]
    prompts = random_prompts([5, 30], seed=22, prefix=system) + random_prompts([3, 150], seed=23)
    llm = triton_llm(model, block_size=16, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    runner = llm.engine.runner
    # The decode path a CUDA graph replays (padding rows, graph-held LM head and argmax), eagerly.
    runner.graphs = CudaGraphRunner(runner.model, runner.inputs, runner.kv_cache.layers, [2, 4],
                                    llm.config.max_model_len, runner.device, capture=False)
    first = llm.generate(prompts[:1], GREEDY)  # computes and keys the shared prefix
    rest = llm.generate(prompts[1:], GREEDY)  # a prefix hit, fresh prompts, a 150-token prompt in chunks
    assert llm.engine.block_manager.num_hit_tokens > 0
    assert [o.token_ids for o in first + rest] == reference(model, prompts, GREEDY.max_tokens)
