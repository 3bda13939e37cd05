"""logit_bias (OpenAI's field): greedy outputs equal transformers' `sequence_bias` with the same
single-token biases, beside requests without one; bad values are refused naming the field."""

from __future__ import annotations

import pytest

from fastgen import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.tiny_models import hf_greedy


def test_logit_bias_greedy_equals_transformers(tiny_models, reference):
    model = tiny_models["qwen3"]
    prompts = random_prompts([6, 9, 4], seed=21)
    plain = reference(model, prompts, 12)
    # Ban each prompt's own first greedy token and push another one up: the outputs must change.
    biases = [{plain[0][0]: -100.0, 7: 5.0}, None, {plain[2][0]: -100.0, plain[2][1]: 40.0}]
    outs = LLM(model, dtype="float32").generate(
        prompts, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=b) for b in biases])
    for prompt, out, bias, unbiased in zip(prompts, outs, biases, plain):
        expected = unbiased if bias is None else hf_greedy(
            model, [prompt], 12, sequence_bias={(t,): b for t, b in bias.items()})[0]
        assert out.outputs[0].token_ids == expected
    assert outs[0].outputs[0].token_ids != plain[0] and outs[2].outputs[0].token_ids != plain[2]


@pytest.mark.parametrize("bias, message", [
    ({5: 100.5}, r"logit_bias\[5\]=100.5 must be in \[-100, 100\]"),
    ({-1: 1.0}, "logit_bias key=-1 must be >= 0"),
    ({"5": 1.0}, "logit_bias key='5' must be an integer"),
    ([5], "logit_bias=.* must be a dict"),
    (dict.fromkeys(range(1025), 1.0), "logit_bias holds 1025 entries, more than 1024"),
])
def test_bad_logit_bias_is_refused(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_logit_bias_outside_the_vocabulary_is_refused(tiny_models):
    llm = LLM(tiny_models["qwen3"], dtype="float32")
    with pytest.raises(ValueError, match=r"logit_bias names token 384, outside the vocabulary \[0, 384\)"):
        llm.generate([5, 6], SamplingParams(logit_bias={384: 1.0}))


def test_the_sampler_keeps_a_requests_bias_until_it_finishes():
    """The bias map is turned into tensors once a request, not every step; a sequence id met
    again with another map (a sampler outside the engine) gets that map's bias."""
    import torch

    from fastgen.compile import build_op_set
    from fastgen.sequence import Sequence
    from fastgen.worker.sampler import Sampler

    sampler = Sampler(16, torch.device("cpu"), 0, build_op_set(False).sample_tokens)
    logits = torch.zeros(2, 16)
    first = [Sequence(0, [1], SamplingParams(temperature=0, logit_bias={3: 5.0})),
             Sequence(1, [1], SamplingParams(temperature=0))]
    assert sampler(logits, first).tolist() == [3, 0]
    assert sampler(logits, first).tolist() == [3, 0] and list(sampler.logit_biases) == [0]
    again = [Sequence(0, [1], SamplingParams(temperature=0, logit_bias={9: 1.0, 3: -1.0}))]
    assert sampler(logits[:1], again).tolist() == [9]
    sampler.release([0])
    assert not sampler.logit_biases
