"""vLLM's sampling fields against transformers: repetition_penalty equals generate()'s, presence
and frequency penalties equal a float64 reference of OpenAI's formula, min_tokens equals
generate(min_new_tokens=...), and logprobs equal log_softmax of transformers' logits."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from fastgen import LLM, SamplingParams
from tests.conftest import FAMILIES, random_prompts
from tests.tiny_models import VOCAB_SIZE, build_tiny_model, hf_greedy

MAX_TOKENS = 24
PROMPTS = random_prompts([5, 19, 40], seed=21)


def make_llm(model: str, **kwargs) -> LLM:
    return LLM(model, dtype="float32", block_size=16, num_kv_blocks=128, **kwargs)


def assert_engine_clean(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_repetition_penalty_equals_transformers(tiny_models, reference, family):
    model = tiny_models[family]
    llm = make_llm(model)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3)
    outputs = llm.generate(PROMPTS, params)
    expected = hf_greedy(model, PROMPTS, MAX_TOKENS, repetition_penalty=1.3)
    assert [o.token_ids for o in outputs] == expected
    assert expected != reference(model, PROMPTS, MAX_TOKENS)  # the penalty changed something
    assert_engine_clean(llm)


def openai_penalised_greedy(model_dir: str, prompt: list[int], max_tokens: int, presence: float,
                            frequency: float) -> list[int]:
    """Greedy over transformers' logits, penalised in float64 by OpenAI's formula:
    logit[j] -= count[j] * frequency + (count[j] > 0) * presence, over generated tokens."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids, counts = list(prompt), Counter()
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            count = torch.zeros(VOCAB_SIZE, dtype=torch.float64)
            for token, n in counts.items():
                count[token] = n
            token = int((logits - count * frequency - (count > 0).double() * presence).argmax())
            ids.append(token)
            counts[token] += 1
    return ids[len(prompt):]


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
@pytest.mark.parametrize("presence,frequency", [(0.7, 0.0), (0.0, 0.6), (0.5, 0.3), (-0.4, 0.2)])
def test_presence_and_frequency_penalties_equal_float64_openai_formula(tiny_models, reference, family,
                                                                      presence, frequency):
    model = tiny_models[family]
    llm = make_llm(model)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            presence_penalty=presence, frequency_penalty=frequency)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == openai_penalised_greedy(model, prompt, MAX_TOKENS, presence, frequency)
    assert [o.token_ids for o in outputs] != reference(model, PROMPTS, MAX_TOKENS)
    assert_engine_clean(llm)


def repeated_token(tokens: list[int]) -> tuple[int, int]:
    """A token that greedy decoding produces early and again later: (token, first index)."""
    for i, token in enumerate(tokens):
        if token in tokens[i + 1 :]:
            return token, i
    raise AssertionError(f"no token repeats in {tokens}")


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_min_tokens_suppresses_stop_token_ids_exactly_that_long(tiny_models, reference, family):
    model = tiny_models[family]
    prompt = PROMPTS[1]
    plain = reference(model, [prompt], MAX_TOKENS)[0]
    stop, first = repeated_token(plain)
    llm = make_llm(model)
    base = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop])
    (early,) = llm.generate([prompt], SamplingParams(**base))
    assert early.token_ids == plain[: first + 1] and early.finish_reason == "stop"
    for min_tokens in (first + 1, first + 3):
        (out,) = llm.generate([prompt], SamplingParams(**base, min_tokens=min_tokens))
        expected = hf_greedy(model, [prompt], MAX_TOKENS, eos_token_id=stop, min_new_tokens=min_tokens)[0]
        assert out.token_ids == expected
        assert stop not in out.token_ids[:min_tokens]
        assert out.finish_reason == ("stop" if out.token_ids[-1] == stop else "length")
    assert_engine_clean(llm)


def test_min_tokens_suppresses_the_models_eos(tiny_models, reference, tmp_path):
    prompt = PROMPTS[2]
    plain = reference(tiny_models["qwen3"], [prompt], MAX_TOKENS)[0]
    eos, first = repeated_token(plain)
    # The same weights (same seed), with that token as the model's end-of-sequence.
    model = str(build_tiny_model("qwen3", tmp_path / "eos", eos_token_id=eos))
    llm = make_llm(model)
    (early,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert early.token_ids == plain[: first + 1] and early.finish_reason == "stop"
    min_tokens = first + 2
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=min_tokens))
    assert out.token_ids == hf_greedy(model, [prompt], MAX_TOKENS, eos_token_id=eos, min_new_tokens=min_tokens)[0]
    assert eos not in out.token_ids[:min_tokens] and len(out.token_ids) > min_tokens
    # ignore_eos: end-of-sequence is neither a stop nor banned, as in vLLM.
    (ignored,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=min_tokens,
                                                       ignore_eos=True))
    assert ignored.token_ids == plain


def transformers_logprobs(model_dir: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of transformers' float32 logits over prompt + output: row p scores token p + 1."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_position_matches(entry: dict, row: torch.Tensor, chosen: int, k: int) -> None:
    """entry: {token: Logprob} for one position; row: transformers' logprobs there."""
    top = row.topk(k)
    assert set(entry) == {chosen, *top.indices.tolist()}
    for token, logprob in entry.items():
        assert logprob.logprob == pytest.approx(row[token].item(), abs=1e-4)
    assert entry[chosen].rank == int((row >= row[chosen]).sum())
    for rank, token in enumerate(top.indices.tolist(), 1):
        assert entry[token].rank == rank


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_equal_transformers_log_softmax(tiny_models, family):
    model = tiny_models[family]
    # A small token budget: the 40-token prompt's logprobs come from two chunks.
    llm = make_llm(model, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=4, prompt_logprobs=2)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        logprobs = transformers_logprobs(model, prompt, out.token_ids)
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(out.token_ids)
        for t, (token, entry) in enumerate(zip(out.token_ids, completion.logprobs)):
            assert_position_matches(entry, logprobs[len(prompt) - 1 + t], token, 4)
        assert completion.cumulative_logprob == pytest.approx(
            sum(entry[token].logprob for token, entry in zip(out.token_ids, completion.logprobs)))
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            assert_position_matches(out.prompt_logprobs[p], logprobs[p - 1], prompt[p], 2)
        assert next(iter(completion.logprobs[0].values())).decoded_token == llm.tokenizer.decode(
            [out.token_ids[0]], skip_special_tokens=False)
    assert_engine_clean(llm)


def test_prompt_logprobs_do_not_read_the_prefix_cache(tiny_models):
    model = tiny_models["qwen3"]
    llm = make_llm(model)
    prompt = PROMPTS[2]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))  # its blocks are now cached
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))
    assert out.metrics.num_cached_tokens == 0
    assert all(entry is not None for entry in out.prompt_logprobs[1:])
    (cached,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))
    assert cached.metrics.num_cached_tokens > 0 and cached.prompt_logprobs is None
