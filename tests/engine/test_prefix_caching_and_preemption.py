"""Prefix-cache hits and preemption change how the work is done, never the tokens."""

from __future__ import annotations

import pytest

from fastgen import LLM, SamplingParams
from tests.conftest import FAMILIES, random_prompts

MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run_checked(llm: LLM, prompts, params=GREEDY):
    """generate() one step at a time, checking the block manager's invariants after each step."""
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [done[i] for i in ids]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_shared_system_prefix_hits_cache(tiny_models, reference, family, block_size):
    model = tiny_models[family]
    system = random_prompts([64], seed=11)[0]
    prompts = random_prompts([3, 10, 25], seed=12, prefix=system)
    llm = LLM(model, dtype="float32", block_size=block_size, num_kv_blocks=1024 // block_size)
    first = run_checked(llm, prompts[:1])  # computes and keys the system prefix
    rest = run_checked(llm, prompts[1:])
    expected = reference(model, prompts, MAX_TOKENS)
    assert [o.token_ids for o in first + rest] == expected
    assert all(o.metrics.num_cached_tokens >= len(system) - block_size for o in rest)
    assert llm.engine.block_manager.num_hit_tokens > 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [1, 8, 256])
def test_same_prompt_twice_full_hit_still_computes_last_token(tiny_models, reference, family, block_size):
    model = tiny_models[family]
    prompt = random_prompts([32], seed=5)[0]  # a whole number of blocks for sizes 1 and 8
    llm = LLM(model, dtype="float32", block_size=block_size, num_kv_blocks=2048 // block_size + 4)
    (first,) = run_checked(llm, [prompt])
    (second,) = run_checked(llm, [prompt])
    expected = reference(model, [prompt], MAX_TOKENS)[0]
    assert first.token_ids == expected and second.token_ids == expected
    if block_size <= 32:
        assert second.metrics.num_cached_tokens == (32 // block_size) * block_size
    # A prompt identical to a running one in the same batch is fine too.
    both = run_checked(llm, [prompt, prompt])
    assert [o.token_ids for o in both] == [expected, expected]


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_under_tiny_kv_budget(tiny_models, reference, family):
    model = tiny_models[family]
    prompts = random_prompts([20, 35, 12, 50, 28, 41], seed=21)
    block_size = 8
    max_model_len = 80
    # Room for about two sequences at a time: the rest get preempted and recomputed.
    llm = LLM(
        model, dtype="float32", block_size=block_size, max_model_len=max_model_len,
        num_kv_blocks=max_model_len // block_size + 4, max_num_seqs=6,
    )
    outputs = run_checked(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == reference(model, prompts, MAX_TOKENS)


def test_preemption_with_prefix_caching_disabled(tiny_models, reference):
    model = tiny_models["qwen3"]
    prompts = random_prompts([30, 30, 30, 30], seed=3)
    llm = LLM(
        model, dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=20,
        enable_prefix_caching=False,
    )
    outputs = run_checked(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_hit_tokens == 0
    assert [o.token_ids for o in outputs] == reference(model, prompts, MAX_TOKENS)
