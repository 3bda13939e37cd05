"""Every output reaches its own consumer, whoever drove the engine when it was made: streams
read interleaved in one thread, a generate() between two next() calls, requests added with
add_request while generate() or a stream drives, and exactly one final output per request."""

from __future__ import annotations

import gc

import pytest

from fastgen import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.engine.conftest import step_limit

N = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["qwen3"], dtype="float32", block_size=8, num_kv_blocks=256, max_model_len=256)


@pytest.fixture
def engine(llm):
    """The engine, under a step limit; every test must leave it with nothing in it."""
    with step_limit(llm.engine):
        yield llm.engine
    engine = llm.engine
    assert not engine.requests and not engine.outbox.mailboxes and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([6, 13, 9, 4], seed=51)


@pytest.fixture(scope="module")
def expected(reference, tiny_models, prompts):
    return reference(tiny_models["qwen3"], prompts, N)


def tokens(deltas) -> list[int]:
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True], "exactly one final output, last"
    return sum((d.new_token_ids for d in deltas), [])


def test_two_streams_read_one_after_the_other(llm, engine, prompts, expected):
    a, b = llm.stream(prompts[0], GREEDY), llm.stream(prompts[1], GREEDY)
    # Reading `a` drives `b`'s request too: its outputs wait for `b`, none is thrown away.
    assert tokens(list(a)) == expected[0]
    assert tokens(list(b)) == expected[1]


def test_streams_read_interleaved_next_by_next(llm, engine, prompts, expected):
    streams = [llm.stream(p, GREEDY) for p in prompts[:3]]
    deltas = [[], [], []]
    while not all(d and d[-1].finished for d in deltas):
        for i, stream in enumerate(streams):
            output = next(stream, None)
            if output is not None:
                deltas[i].append(output)
    assert [tokens(d) for d in deltas] == expected[:3]
    assert "".join(d.new_text for d in deltas[2]) == deltas[2][-1].text


def test_generate_between_two_next_calls_takes_none_of_the_streams_outputs(llm, engine, prompts, expected):
    stream = llm.stream(prompts[0], GREEDY)
    first = next(stream)
    (out,) = llm.generate([prompts[1]], GREEDY)  # drives the stream's request to its end
    assert out.token_ids == expected[1]
    assert tokens([first, *stream]) == expected[0]


def test_generate_keeps_the_outputs_of_requests_added_with_add_request(llm, engine, prompts, expected):
    request_id = engine.add_request(prompts[2], GREEDY)
    outputs = llm.generate([prompts[3]], SamplingParams(temperature=0.0, max_tokens=2 * N, ignore_eos=True))
    assert len(outputs[0].token_ids) == 2 * N
    deltas = []  # made while generate() drove the engine, handed out by the next step()
    while engine.has_unfinished_requests():
        deltas += [o for o in engine.step() if o.request_id == request_id]
    assert tokens(deltas) == expected[2]


def test_step_gets_the_outputs_made_while_a_stream_drove(llm, engine, prompts, expected):
    request_id = engine.add_request(prompts[1], GREEDY)
    stream_deltas = list(llm.stream(prompts[0], SamplingParams(temperature=0.0, max_tokens=3 * N, ignore_eos=True)))
    assert stream_deltas[-1].finished
    deltas = engine.step()
    assert tokens([d for d in deltas if d.request_id == request_id]) == expected[1]


def test_a_stream_dropped_before_its_first_next_frees_its_request(llm, engine, prompts):
    dropped = llm.stream(prompts[0], LONG)
    other = llm.stream(prompts[1], GREEDY)
    next(other)  # runs the dropped stream's request too: it now holds blocks
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    request_id = dropped.request_id
    del dropped
    gc.collect()
    list(other)
    assert request_id not in engine.requests


def test_a_stream_left_in_a_with_block_is_aborted(llm, engine, prompts):
    with llm.stream(prompts[0], LONG) as stream:
        next(stream)
    assert stream.request_id not in engine.requests
    assert list(stream) == []


def test_an_aborted_stream_yields_one_final_abort_output(llm, engine, prompts):
    stream = llm.stream(prompts[0], LONG)
    first = next(stream)
    assert engine.abort(stream.request_id)
    rest = list(stream)
    assert len(rest) == 1 and rest[0].finished and rest[0].finish_reason == "abort"
    assert rest[0].token_ids == first.token_ids
    assert stream.result() is rest[0]


def test_an_aborted_add_request_gets_its_final_output_from_step(llm, engine, prompts):
    request_id = engine.add_request(prompts[0], LONG)
    engine.step()
    assert engine.abort(request_id)
    assert engine.abort(request_id) is False  # once
    finals = [o for o in engine.step() if o.request_id == request_id]
    assert len(finals) == 1 and finals[0].finish_reason == "abort" and len(finals[0].token_ids) == 1


def test_generate_reports_a_request_aborted_during_its_run(llm, engine, prompts, expected):
    from fastgen.engine.run_loop import run_to_completion

    states = [engine.prepare(p, LONG if i == 0 else GREEDY, final_only=True) for i, p in enumerate(prompts[:2])]

    def abort_first(step):
        if step.is_prefill is False:
            engine.abort(states[0].request_id)

    outputs = run_to_completion(engine, states, on_step=abort_first)
    assert outputs[0].finish_reason == "abort" and outputs[0].text is not None
    assert outputs[1].token_ids == expected[1]
