"""Greedy decoding equals transformers' generate(do_sample=False), token for token."""

from __future__ import annotations

import pytest
import torch

from fastgen import LLM, SamplingParams
from tests.conftest import FAMILIES, random_prompts
from tests.tiny_models import hf_greedy

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def assert_engine_clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants([])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [1, 3, 16, 256])
def test_batch_of_varied_prompts(tiny_models, reference, family, block_size):
    model = tiny_models[family]
    prompts = random_prompts([1, 7, 16, 33, 100, 257], seed=block_size)
    llm = LLM(model, dtype="float32", block_size=block_size, num_kv_blocks=4096 // block_size + 8)
    outputs = llm.generate(prompts, GREEDY)
    expected = reference(model, prompts, MAX_TOKENS)
    for prompt, out, want in zip(prompts, outputs, expected):
        assert out.token_ids == want, f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"
    assert_engine_clean(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_text_prompts_and_mixed_batch_order(tiny_models, reference, family):
    model = tiny_models[family]
    llm = LLM(model, dtype="float32", block_size=16, num_kv_blocks=256)
    texts = ["The quick brown fox", "Paged attention keeps", "café naïve 東京"]
    token_prompts = [llm.tokenizer.encode(t) for t in texts]
    outputs = llm.generate(texts, GREEDY)
    expected = reference(model, token_prompts, MAX_TOKENS)
    assert [o.token_ids for o in outputs] == expected
    assert [o.prompt for o in outputs] == texts
    for out in outputs:
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True) or out.text.endswith(
            llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        )
    assert_engine_clean(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_longer_than_token_budget_is_chunked(tiny_models, reference, family):
    model = tiny_models[family]
    prompts = random_prompts([150, 40, 90], seed=7)
    llm = LLM(model, dtype="float32", block_size=16, num_kv_blocks=256, max_num_batched_tokens=32)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference(model, prompts, MAX_TOKENS)
    assert_engine_clean(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_tracks_transformers_in_bfloat16(tiny_models, family):
    """In bf16 the two engines round differently (merged projections, other kernels), so a long
    greedy run may drift apart after a near-tie; the first tokens must still agree."""
    model = tiny_models[family]
    prompts = random_prompts([5, 30, 64], seed=3)
    llm = LLM(model, dtype="bfloat16", block_size=16, num_kv_blocks=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    expected = hf_greedy(model, prompts, 3, dtype=torch.bfloat16)
    assert [o.token_ids[:2] for o in outputs] == [e[:2] for e in expected]
    assert_engine_clean(llm)
