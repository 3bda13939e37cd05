"""A failure inside a step fails only the requests it belongs to, never the loop: a request
that fails when it runs alone ends with finish_reason "error"; everyone else's tokens are still
exactly transformers' greedy tokens; `step()` never raises for it; the background loop lives on."""

from __future__ import annotations

import pytest

from fastgen import LLM, SamplingParams
from tests.conftest import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
POISON = 377  # a prompt holding this token makes the model raise whenever that request is in the batch


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["qwen3"], dtype="float32", block_size=8, num_kv_blocks=128, max_model_len=256,
               max_num_seqs=8)


@pytest.fixture
def poisoned(llm, monkeypatch):
    """The model raises on any step whose input holds POISON (as a request-specific bug would)."""
    model = llm.engine.runner.model
    forward = model.forward

    def poisoned_forward(input_ids, *args):
        if bool((input_ids == POISON).any()):
            raise RuntimeError("poisoned input")
        return forward(input_ids, *args)

    monkeypatch.setattr(model, "forward", poisoned_forward)
    return llm


def assert_clean(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.requests
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.suspects


def test_a_top_k_beyond_int64_runs_beside_other_requests(llm, reference, tiny_models):
    """top_k=2**63 used to pass validation and then fail every step building the sampler's
    int64 tensor, taking the good requests beside it down."""
    prompts = random_prompts([7, 11, 5], seed=41)
    huge = SamplingParams(temperature=1.0, top_k=2**63, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, [GREEDY, huge, GREEDY])
    expected = reference(tiny_models["qwen3"], prompts, 12)
    assert [outputs[0].token_ids, outputs[2].token_ids] == [expected[0], expected[2]]
    assert outputs[1].finish_reason == "length" and len(outputs[1].token_ids) == 12
    assert_clean(llm)


def test_a_request_that_fails_alone_ends_with_error_and_spares_its_batch(poisoned, reference, tiny_models):
    prompts = random_prompts([9, 14, 6, 20], seed=42)
    prompts[2] = prompts[2][:3] + [POISON] + prompts[2][3:]
    outputs = poisoned.generate(prompts, GREEDY)
    bad = outputs[2]
    assert bad.finished and bad.finish_reason == "error" and "poisoned input" in bad.error
    expected = reference(tiny_models["qwen3"], prompts, 12)
    for i in (0, 1, 3):
        assert outputs[i].finish_reason == "length" and outputs[i].error is None
        assert outputs[i].token_ids == expected[i]
    assert_clean(poisoned)
    # ... and the engine goes on serving, batched again.
    again = poisoned.generate(prompts[:2], GREEDY)
    assert [o.token_ids for o in again] == expected[:2]


def test_a_transient_failure_costs_no_request(llm, monkeypatch, reference, tiny_models):
    """A batch that fails once (an out-of-memory spike, say) is retried one sequence at a time:
    every request still finishes with transformers' tokens."""
    runner = llm.engine.runner
    launch = runner.launch
    failures = []

    def fail_once(out):
        if len(out.seqs) > 1 and not failures:
            failures.append(len(out.seqs))
            raise RuntimeError("transient")
        return launch(out)

    monkeypatch.setattr(runner, "launch", fail_once)
    prompts = random_prompts([8, 13, 5], seed=43)
    outputs = llm.generate(prompts, GREEDY)
    assert failures == [3]
    assert [o.finish_reason for o in outputs] == ["length"] * 3
    assert [o.token_ids for o in outputs] == reference(tiny_models["qwen3"], prompts, 12)
    assert_clean(llm)


def test_step_returns_the_failed_requests_final_output_instead_of_raising(poisoned):
    engine = poisoned.engine
    good = engine.add_request([5, 6, 7], GREEDY)
    bad = engine.add_request([5, POISON, 7], GREEDY)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():  # never raises
            if out.finished:
                assert out.request_id not in finals, "two final outputs for one request"
                finals[out.request_id] = out
    assert finals[bad].finish_reason == "error" and finals[good].finish_reason == "length"
    assert_clean(poisoned)


def test_a_stream_of_a_failing_request_ends_with_its_error(poisoned):
    deltas = list(poisoned.stream([1, POISON], GREEDY))
    assert len(deltas) == 1 and deltas[0].finish_reason == "error"
    assert_clean(poisoned)


def test_the_background_loop_survives_a_failing_step(poisoned):
    with poisoned.background() as bg:
        bad = bg.submit([4, POISON, 4], GREEDY)
        good = bg.submit([4, 5, 6], GREEDY)
        assert bad.result().finish_reason == "error"
        assert good.result().finish_reason == "length"
        later = bg.submit([7, 8], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)).result()
        assert later.finish_reason == "length" and len(later.token_ids) == 3
    assert_clean(poisoned)


def test_a_failure_outside_the_model_fails_every_request_and_the_engine_stays_usable(llm, monkeypatch):
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in random_prompts([4, 6], seed=44)]
    schedule = engine.scheduler.schedule
    calls = []

    def broken_once():
        calls.append(1)
        if len(calls) == 2:
            raise AssertionError("scheduler bug")
        return schedule()

    monkeypatch.setattr(engine.scheduler, "schedule", broken_once)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert {finals[i].finish_reason for i in ids} == {"error"}
    assert "scheduler bug" in finals[ids[0]].error
    assert_clean(llm)
    assert llm.generate([[1, 2, 3]], GREEDY)[0].finish_reason == "length"


@pytest.mark.parametrize("same_step", [False, True], ids=["next-step", "same-step"])
def test_a_read_back_failure_of_an_aborted_requests_step_spares_the_survivor(tiny_models, reference, monkeypatch,
                                                                             same_step):
    """Overlap scheduling: a step whose token read fails held a request that was aborted while
    it was in flight; the request that survives it (in that step, or in the step launched after
    it and lost with it) ran beside the culprit, not alone, so it is retried, not failed."""
    from fastgen import model_runner

    llm = LLM(tiny_models["qwen3"], dtype="float32", block_size=4, num_kv_blocks=32, max_model_len=64,
              max_num_seqs=4 if same_step else 1, overlap_scheduling=True)
    bad_steps = set()
    launch, collect = model_runner.ModelRunner.launch, model_runner.ModelRunner.collect

    def launch_marking(self, out):
        step = launch(self, out)
        if any(seq.token_ids[0] == POISON for seq in out.seqs):
            bad_steps.add(id(step))
        return step

    def collect_failing(self, step):
        if id(step) in bad_steps:
            bad_steps.discard(id(step))
            raise RuntimeError("read-back failed")
        return collect(self, step)

    monkeypatch.setattr(model_runner.ModelRunner, "launch", launch_marking)
    monkeypatch.setattr(model_runner.ModelRunner, "collect", collect_failing)
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    good = random_prompts([6], seed=44)[0]
    engine.add_request([POISON, 1, 2, 3, 4], params, request_id="bad")
    if same_step:
        engine.add_request(good, params, request_id="good")
    outputs = engine.step()  # the step stays in flight
    if not same_step:
        engine.add_request(good, params, request_id="good")
    engine.abort("bad")
    while engine.has_unfinished_requests():
        outputs += engine.step()
    finals = {o.request_id: o for o in outputs if o.finished}
    assert finals["bad"].finish_reason == "abort"
    assert (finals["good"].finish_reason, finals["good"].error) == ("length", None)
    assert finals["good"].token_ids == reference(tiny_models["qwen3"], [good], 5)[0]
    assert_clean(llm)
