"""Speculative decoding with a draft model: greedy output equals transformers' token for token in
float32 whatever the draft model (the model itself: every draft kept; a perturbed copy: some
kept; an unrelated model: none), through chunked catch-ups, a draft cache too small for every
sequence, preemption, aborts, n > 1, seeds and a failing draft model; bad settings are refused
naming the key."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastgen import LLM, SamplingParams
from fastgen.config import EngineConfig
from tests.conftest import FAMILIES, random_prompts
from tests.tiny_models import build_tiny_model

MAX_TOKENS = 24
NOISE = 0.05  # of each weight tensor's spread: drafts kept about half the time


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=extra.pop("max_tokens", MAX_TOKENS), ignore_eos=True, **extra)


def draft_config(model: str, k: int = 4, **extra) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, **extra}


def spec_llm(target: str, draft: str, k: int = 4, **kwargs) -> LLM:
    """An engine whose sequences draft k tokens every step (the drafter's costs set to nothing:
    these tests are about verification, not about when drafting pays)."""
    settings = dict(dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=96) | kwargs
    llm = LLM(target, speculative_config=draft_config(draft, k), **settings)
    llm.engine.drafter.row_cost = 0.0
    return llm


@pytest.fixture(scope="module")
def perturbed(tiny_models, tmp_path_factory) -> dict[str, str]:
    """Per family, the tiny model with noise added to its weights: a draft model that agrees with
    it on some tokens and not others."""
    root = tmp_path_factory.mktemp("perturbed")
    out = {}
    for family in FAMILIES:
        model = AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32)
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * param.std() * NOISE)
        model.save_pretrained(root / family)
        AutoTokenizer.from_pretrained(tiny_models[family]).save_pretrained(root / family)
        out[family] = str(root / family)
    return out


def check_books(llm: LLM) -> None:
    """The engine's blocks, and the draft cache's against the twins that hold them."""
    llm.engine.check_invariants()
    proposer = llm.engine.drafter.model
    proposer.blocks.check_invariants([twin.seq for twin in proposer.twins.values()])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_a_draft_model_equals_transformers(tiny_models, perturbed, reference, family):
    target = tiny_models[family]
    prompts = random_prompts([9, 21, 6], seed=4) + [random_prompts([5], seed=9)[0] * 5]
    want = reference(target, prompts, MAX_TOKENS)
    unrelated = tiny_models["llama" if family != "llama" else "qwen3"]
    counts = {}
    for name, draft in (("itself", target), ("perturbed", perturbed[family]), ("unrelated", unrelated)):
        llm = spec_llm(target, draft)
        outs = llm.generate(prompts, greedy())
        assert [o.token_ids for o in outs] == want, name
        check_books(llm)
        stats = llm.engine.stats()
        counts[name] = (stats.draft_tokens, stats.accepted_draft_tokens)
        assert stats.accepted_draft_tokens == sum(o.metrics.num_accepted_draft_tokens for o in outs)
    drafted, kept = counts["itself"]
    assert drafted > 0 and kept == drafted  # the model's own greedy drafts are all kept
    drafted, kept = counts["perturbed"]
    assert 0 < kept < drafted, counts
    assert counts["unrelated"][0] > 0


def test_catch_ups_in_chunks_and_a_draft_cache_too_small_for_everyone(tiny_models, reference):
    """A token budget of 12 cuts the draft model's catch-up of longer prompts into chunks; few
    blocks preempt sequences in the engine and drop idle twins from the draft cache."""
    model = tiny_models["qwen3"]
    prompts = random_prompts([7, 30, 11, 26, 15], seed=3)
    want = reference(model, prompts, MAX_TOKENS)
    llm = spec_llm(model, model, k=3, block_size=4, num_kv_blocks=20, max_num_batched_tokens=12,
                   long_prefill_token_threshold=5)
    engine = llm.engine
    finals = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, greedy(), request_id=str(i))
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        check_books(llm)
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        check_books(llm)
    assert [finals[str(i)].token_ids for i in range(len(prompts))] == want
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.accepted_draft_tokens > 0
    proposer = engine.drafter.model
    assert not proposer.twins and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks
    proposer.warm_up()  # a throwaway proposal leaves nothing behind
    assert not proposer.twins and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_aborts_parallel_completions_and_seeds(tiny_models, perturbed, reference):
    model = tiny_models["gpt2"]
    prompts = random_prompts([6, 9], seed=3)
    want = reference(model, prompts, MAX_TOKENS)
    llm = spec_llm(model, perturbed["gpt2"])
    (out,) = llm.generate([prompts[0]], greedy(n=2))
    assert [c.token_ids for c in out.outputs] == [want[0], want[0]]
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, greedy(), request_id=str(i))
    for _ in range(3):
        engine.step()
    assert engine.abort("0")
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        check_books(llm)
    assert finals["0"].finish_reason == "abort" and finals["1"].token_ids == want[1]
    assert not engine.drafter.model.twins and not engine.drafter.seqs
    # A seeded request samples each position from its seed and position alone: drafts kept or
    # not change none of its tokens.
    plain = LLM(model, dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=96)
    sampled = SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, n=3, seed=7)
    (expected,) = plain.generate([prompts[0]], sampled)
    (got,) = llm.generate([prompts[0]], sampled)
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs]


def test_a_failing_draft_model_costs_only_the_drafts(tiny_models, reference, monkeypatch, caplog):
    model = tiny_models["llama"]
    prompts = random_prompts([8, 12], seed=6)
    want = reference(model, prompts, MAX_TOKENS)
    llm = spec_llm(model, model)
    runner = llm.engine.drafter.model.runner
    launch, calls = runner.launch, []

    def failing_now_and_then(out):
        calls.append(out)
        if len(calls) in (3, 4, 9):
            raise RuntimeError("draft step failed")
        return launch(out)

    monkeypatch.setattr(runner, "launch", failing_now_and_then)
    with caplog.at_level(logging.ERROR, logger="fastgen.speculative.draft_model"):
        outs = llm.generate(prompts, greedy())
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)
    assert "the draft model failed" in caplog.text
    assert llm.engine.stats().accepted_draft_tokens > 0  # drafting went on after the failures
    check_books(llm)


def test_the_model_quantized_drafts_for_itself(tiny_models, reference):
    model = tiny_models["qwen2"]
    prompts = random_prompts([10, 5], seed=8)
    want = reference(model, prompts, MAX_TOKENS)
    llm = LLM(model, dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=96,
              speculative_config=draft_config(model, quantization="int8"))
    llm.engine.drafter.row_cost = 0.0
    outs = llm.generate(prompts, greedy())
    assert [o.token_ids for o in outs] == want
    stats = llm.engine.stats()
    assert stats.accepted_draft_tokens > stats.draft_tokens // 2  # int8 agrees with float32 mostly


def test_bad_draft_model_settings_are_refused(tiny_models, tmp_path):
    model = tiny_models["qwen3"]

    def config(spec: dict, **kwargs) -> EngineConfig:
        return EngineConfig(model, speculative_config=spec, **kwargs)

    with pytest.raises(ValueError, match=r"speculative_config\['model'\]=None must name the draft model"):
        config({"method": "draft_model"})
    with pytest.raises(ValueError, match=r"speculative_config\['quantization'\]='int3' is not one of"):
        config(draft_config(model, quantization="int3"))
    with pytest.raises(ValueError, match=r"\['model'\]='.*' is for method 'draft_model', not 'ngram'"):
        config({"method": "ngram", "model": model})
    big = build_tiny_model("qwen3", tmp_path / "big", vocab_size=512)
    with pytest.raises(ValueError, match=r"vocabulary of 512 tokens, more than the model's 384"):
        config(draft_config(str(big)))
    short = build_tiny_model("qwen3", tmp_path / "short", max_position_embeddings=32)
    with pytest.raises(ValueError, match=r"holds 32 positions, fewer than max_model_len=64"):
        config(draft_config(str(short)), max_model_len=64)
    with pytest.raises(ValueError, match=r"speculative_config\['model'\]='.*missing'"):
        config(draft_config(str(Path(tmp_path) / "missing")))


def test_a_sequence_holding_a_token_past_the_draft_vocabulary_does_not_draft(tiny_models, reference, tmp_path):
    """A draft model of a smaller vocabulary (as Qwen's small models pad theirs less): a sequence
    with a token it cannot embed decodes without drafts; the others draft."""
    model = tiny_models["qwen3"]
    small = str(build_tiny_model("qwen3", tmp_path / "small", vocab_size=300))
    prompts = [random_prompts([8], seed=2)[0] + [350], random_prompts([9], seed=3)[0]]
    prompts[1] = [t % 300 for t in prompts[1]]
    want = reference(model, prompts, MAX_TOKENS)
    llm = spec_llm(model, small)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, greedy(), request_id=str(i))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        check_books(llm)
    assert [finals[str(i)].token_ids for i in range(2)] == want
    assert finals["0"].metrics.num_draft_tokens == 0
    assert finals["1"].metrics.num_draft_tokens > 0
    assert not engine.drafter.model.undraftable  # forgotten with their sequences
