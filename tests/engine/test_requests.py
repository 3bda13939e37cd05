"""What a request is once added: string ids, its own copy of its sampling settings, and the
finish reason it ends with."""

from __future__ import annotations

import pytest

from fastgen import LLM, SamplingParams
from tests.conftest import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["qwen3"], dtype="float32", block_size=8, num_kv_blocks=256, max_model_len=256)


def drain(engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    return finals


def test_a_request_keeps_its_own_copy_of_its_params(llm, reference, tiny_models):
    prompt = random_prompts([9], seed=61)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[], stop=[])
    request_id = llm.engine.add_request(prompt, params)
    params.max_tokens = 2
    params.temperature = 5.0
    params.stop_token_ids.append(reference(tiny_models["qwen3"], [prompt], 8)[0][1])
    params.stop.append("a")
    final = drain(llm.engine)[request_id]
    assert final.finish_reason == "length"
    assert final.token_ids == reference(tiny_models["qwen3"], [prompt], 8)[0]


def test_changing_params_after_adding_cannot_bypass_validation(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    request_id = llm.engine.add_request([1, 2, 3], params)
    params.max_tokens = 10**9  # past max_model_len: would have been refused when added
    params.top_k = 0
    final = drain(llm.engine)[request_id]
    assert final.finish_reason == "length" and len(final.token_ids) == 4


@pytest.mark.parametrize("request_id", [5, 5.0, ["a"], {"a": 1}, b"a", ""])
def test_request_ids_must_be_non_empty_strings(llm, request_id):
    with pytest.raises(ValueError, match=r"request_id=.* must be a non-empty string"):
        llm.engine.add_request([1, 2], SamplingParams(max_tokens=1), request_id=request_id)
    with pytest.raises(ValueError, match=r"request_id=.* must be a non-empty string"):
        llm.engine.abort(request_id)
    assert not llm.engine.has_unfinished_requests()


def test_ids_are_strings_and_abort_names_one_request(llm):
    engine = llm.engine
    mine = engine.add_request([1, 2], SamplingParams(max_tokens=4), request_id="5")
    generated = engine.add_request([3, 4], SamplingParams(max_tokens=4))
    assert isinstance(generated, str) and generated != "5"
    assert engine.abort("no-such-request") is False
    assert engine.abort(mine) is True
    finals = drain(engine)
    assert finals[mine].finish_reason == "abort" and finals[generated].finish_reason == "length"


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(llm):
    """vLLM reports "stop" when the stop string appears, even on the last allowed token."""
    prompt = "The quick brown fox"
    for n in range(4, 16):
        full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
        shorter = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n - 1, ignore_eos=True))[0]
        if len(full.text) <= len(shorter.text):
            continue
        # The shortest tail of the text that first appears with the n-th token.
        stop = next((full.text[-k:] for k in range(1, len(full.text) + 1)
                     if full.text.find(full.text[-k:]) == len(full.text) - k
                     and full.text[-k:] not in shorter.text), None)
        if stop:
            break
    else:
        pytest.skip("no token completes a fresh stop string in this output")
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, stop=[stop])
    (cut,) = llm.generate(prompt, params)
    assert cut.finish_reason == "stop" and cut.text == full.text[: len(full.text) - len(stop)]
    deltas = list(llm.stream(prompt, params))
    assert deltas[-1].finish_reason == "stop" and "".join(d.new_text for d in deltas) == cut.text
