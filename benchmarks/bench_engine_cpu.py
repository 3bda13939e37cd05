"""The whole engine on a tiny model on CPU (group `engine-cpu`).

The tiny Qwen3 (2 layers, hidden 64, vocab 384) makes the model's share small, so these mostly
track the engine's own per-step cost with a real forward pass: one decode step of 16 running
sequences, and a short offline `generate` of 8 prompts x 16 tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.decoding import DecodingRequests
from fastgen import LLM, SamplingParams

BLOCK_SIZE = 16
DECODE_BATCH = 16
WARM_STEPS = 4
LAP_STEPS = 64  # measured decode steps before the batch is replaced (lengths stay ~32-128)
DECODE_ROUNDS = 128
GENERATE_PROMPTS = 8
GENERATE_TOKENS = 16
GENERATE_ROUNDS = 12


def tiny_llm(model_dir: str) -> LLM:
    # Blocking: the compiled steps are built in the warm-up rounds, never switched to mid-measurement.
    return LLM(model_dir, dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_kv_blocks=1024, max_num_seqs=64,
               compile_mode="blocking")


@pytest.mark.benchmark(group="engine-cpu")
def test_decode_step_batch16(benchmark, tiny_qwen3):
    llm = tiny_llm(tiny_qwen3)
    requests = DecodingRequests(llm, DECODE_BATCH, (16, 64), WARM_STEPS, LAP_STEPS)
    benchmark.extra_info.update(batch=DECODE_BATCH, block_size=BLOCK_SIZE, model="tiny-qwen3")
    outputs = benchmark.pedantic(requests.step, setup=requests.before_round, rounds=DECODE_ROUNDS, warmup_rounds=4)
    assert outputs == DECODE_BATCH


@pytest.mark.benchmark(group="engine-cpu")
def test_generate_8_prompts_16_tokens(benchmark, tiny_qwen3):
    llm = tiny_llm(tiny_qwen3)
    rng = np.random.default_rng(1)
    vocab = llm.engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=GENERATE_TOKENS, ignore_eos=True)

    def fresh_prompts():  # new tokens every round: no prefix-cache hits between rounds
        return ([rng.integers(1, vocab, n).tolist() for n in rng.integers(16, 64, GENERATE_PROMPTS)], params), {}

    benchmark.extra_info.update(
        prompts=GENERATE_PROMPTS, max_tokens=GENERATE_TOKENS, block_size=BLOCK_SIZE, model="tiny-qwen3"
    )
    outputs = benchmark.pedantic(llm.generate, setup=fresh_prompts, rounds=GENERATE_ROUNDS, warmup_rounds=1)
    assert [len(o.token_ids) for o in outputs] == [GENERATE_TOKENS] * GENERATE_PROMPTS
