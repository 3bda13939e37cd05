"""One batch mixing every sampling field with plain greedy requests: each request gets what it
gets alone (the sampler runs them all in one call; nothing leaks between rows)."""

from __future__ import annotations

import pytest

from fastgen import LLM, SamplingParams
from tests.conftest import random_prompts

MAX_TOKENS = 16
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.4),
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=0.8,
                   frequency_penalty=0.5),
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=6, stop_token_ids=[1, 2, 3]),
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3, prompt_logprobs=2),
    SamplingParams(n=3, temperature=1.0, seed=5, min_p=0.05, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, seed=9, top_k=20, repetition_penalty=1.2, presence_penalty=0.3,
                   max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(n=2, temperature=0.9, seed=17, top_p=0.9, frequency_penalty=0.4, min_tokens=4,
                   max_tokens=MAX_TOKENS),
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
]


def completions(output) -> list[tuple[list[int], str | None]]:
    return [(c.token_ids, c.finish_reason) for c in output.outputs]


def assert_logprobs_close(got, want) -> None:
    if want is None:
        assert got is None
        return
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.keys() == w.keys()
        for token in w:
            assert g[token].logprob == pytest.approx(w[token].logprob, abs=1e-4)
            assert g[token].rank == w[token].rank


class RecordingSampler:
    """Stands in for the runner's sampler, recording each call's mix of rows."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.calls: list[tuple[int, int]] = []  # (rows, rows with a penalty)

    def __call__(self, logits, seqs, greedy_tokens=None, grammar=None):
        self.calls.append((len(seqs), sum(s.params.has_penalties for s in seqs)))
        return self.sampler(logits, seqs, greedy_tokens, grammar)

    def __getattr__(self, name):
        return getattr(self.sampler, name)


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_each_request_of_a_mixed_batch_gets_what_it_gets_alone(tiny_models, family):
    prompts = random_prompts([7, 30, 12, 21, 16, 9, 25, 14, 40], seed=31)
    llm = LLM(tiny_models[family], dtype="float32", block_size=8, num_kv_blocks=512, max_model_len=256)
    recorder = llm.engine.runner.sampler = RecordingSampler(llm.engine.runner.sampler)
    together = llm.generate(prompts, PARAMS)
    # One sampler call a step, penalised rows and plain ones together.
    assert len(recorder.calls) == llm.engine.num_steps
    assert any(0 < penalised < rows for rows, penalised in recorder.calls)
    # Fewer sampler rows than requests per step, and other companions: the same outputs again.
    alone = [llm.generate([p], sp)[0] for p, sp in zip(prompts, PARAMS)]
    for params, a, b in zip(PARAMS, together, alone):
        assert completions(a) == completions(b), params
        assert len(a.outputs) == params.n
        for ca, cb in zip(a.outputs, b.outputs):
            assert_logprobs_close(ca.logprobs, cb.logprobs)
        assert_logprobs_close(a.prompt_logprobs, b.prompt_logprobs)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
