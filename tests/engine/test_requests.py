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


def test_a_stop_string_wholly_before_min_tokens_is_never_matched_whatever_else_is_looked_for(llm):
    """Before min_tokens no stop string matches; an occurrence that lies wholly in that text
    stays unmatched later, also beside a longer stop string (whose search window reaches back
    further: vLLM looks for each string only where it would end in the new text)."""
    tokenizer = llm.engine.tokenizer
    checked = 0
    for prompt in random_prompts([9] * 8, seed=4):
        (full,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        for m in range(2, 20):
            before = tokenizer.decode(full.token_ids[:m])
            c = before[-1:]
            if not c.strip() or c in before[:-1] or c not in full.text[len(before):]:
                continue  # wanted: a character first completed by the token min_tokens allows, seen again later
            cut = full.text.index(c, len(before))
            if "\ufffd" in full.text[: cut + 1]:
                continue  # a stray byte: the stream holds it back where the whole text does not
            alone, beside = (llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                                 min_tokens=m, stop=stop))[0]
                             for stop in ([c], [c, "~never~occurs~"]))
            assert (alone.text, alone.finish_reason) == (full.text[:cut], "stop")
            assert (beside.text, beside.token_ids) == (alone.text, alone.token_ids)
            checked += 1
    assert checked, "no character of the outputs fits the case"


def test_seeds_that_differ_only_above_bit_31_sample_differently(llm):
    """SamplingParams takes seeds in [0, 2**64); the CPU's generator keeps 32 bits of a seed, so
    the sampler folds the rest in rather than dropping it."""
    prompt = random_prompts([6], seed=8)[0]
    outputs = [llm.generate([prompt], SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True, seed=seed))[0]
               for seed in (5, 5 + 2**32, 5 + 2**40, 5 + 2**63, 5)]
    ids = [tuple(o.token_ids) for o in outputs]
    assert len(set(ids[:4])) == 4 and ids[4] == ids[0]


def test_tokens_taken_several_at_a_time_match_stop_strings_as_one_at_a_time():
    """A step's several tokens (accepted drafts) are looked at one by one, each with its own
    output count for min_tokens: a stop string completed before min_tokens is not matched in
    them either, nor found again once the step's last token passes min_tokens."""
    from fastgen.engine.request_state import RequestState
    from fastgen.sequence import Sequence
    from tests.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    prompt = tokenizer.encode("Paged attention")
    output = tokenizer.encode(" keeps the KV cache in blocks")[:6]
    pieces = [tokenizer.decode(output[: i + 1])[len(tokenizer.decode(output[:i])):] for i in range(len(output))]
    stop = pieces[1]  # completed by the second output token, and found nowhere else
    assert stop.strip() and stop not in pieces[0] and stop not in "".join(pieces[2:])
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=3, stop=[stop]).validated_copy()

    def run(chunks):
        seq = Sequence(0, list(prompt), params)
        state = RequestState("r", seq, None, tokenizer, 0.0)
        for chunk in chunks:
            seq.token_ids.extend(chunk)
            if state.on_new_tokens(0.0):
                break
        return state.text, seq.output_token_ids

    one_at_a_time = run([[t] for t in output])
    assert one_at_a_time == (tokenizer.decode(output), output)
    assert run([output[:4], output[4:]]) == run([output[:1], output[1:]]) == one_at_a_time


def test_max_waiting_requests_counts_requests_waiting_for_their_first_schedule(tiny_models):
    """Not the preempted sequences and forked children that wait in the same queue: one running
    request of n=32 on a small cache must not make the engine refuse the next request."""
    from fastgen.engine.requests import EngineOverloaded

    llm = LLM(tiny_models["qwen3"], dtype="float32", block_size=8, num_kv_blocks=64, max_model_len=256,
              max_waiting_requests=2)
    engine = llm.engine
    engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True, n=32))
    for _ in range(500):
        if len(engine.scheduler.waiting) > 2 and engine.scheduler.num_preemptions:
            break
        engine.step()
    else:
        pytest.fail("the n=32 request never had sequences preempted back into the queue")
    engine.add_request([8, 9], SamplingParams(max_tokens=2))
    engine.add_request([8, 9], SamplingParams(max_tokens=2))
    with pytest.raises(EngineOverloaded, match="2 requests are waiting"):  # the cap itself still holds
        engine.add_request([8, 9], SamplingParams(max_tokens=2))
    drain(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
