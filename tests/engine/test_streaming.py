"""Streaming, abort, stop strings, per-request metrics and the background loop."""

from __future__ import annotations

import threading

import pytest

from fastgen import LLM, SamplingParams
from fastgen.engine.detokenizer import IncrementalDetokenizer
from tests.conftest import random_prompts
from tests.tiny_models import build_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["qwen3"], dtype="float32", block_size=8, num_kv_blocks=256, max_model_len=256)


def assert_clean(llm):
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_invariants()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("text", ["Grüße aus Köln! 東京は晴れ。 🚀✨ café", "plain ascii text, with punctuation."])
def test_incremental_detokenizer_handles_multibyte(text):
    tok = build_tokenizer()
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    pieces = [detok.add([t]) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_detokenizer_on_random_ids_matches_full_decode():
    tok = build_tokenizer()
    ids = random_prompts([200], seed=9)[0]
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    text = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert text == tok.decode(ids, skip_special_tokens=True)


def test_stream_concatenates_to_generate(llm):
    prompt = "The quick brown fox"
    (full,) = llm.generate([prompt], GREEDY)
    deltas = list(llm.stream(prompt, GREEDY))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.new_text for d in deltas) == full.text
    assert sum((d.new_token_ids for d in deltas), []) == full.token_ids
    assert deltas[-1].text == full.text
    assert_clean(llm)


def test_closing_a_stream_early_aborts_it(llm):
    stream = llm.stream("Paged attention keeps", GREEDY)
    next(stream)
    next(stream)
    stream.close()
    assert_clean(llm)


def test_abort_frees_blocks_and_spares_others(llm, reference, tiny_models):
    engine = llm.engine
    prompts = random_prompts([30, 12, 45], seed=13)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    finished = {}
    for _ in range(3):
        engine.step()
    used_before = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    assert engine.abort(ids[1])
    assert engine.block_manager.num_blocks - engine.block_manager.num_free_blocks < used_before
    engine.check_invariants()
    assert not engine.abort(ids[1])  # already gone
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.check_invariants()
    assert set(finished) == set(ids)
    assert finished[ids[1]].finish_reason == "abort"  # step() hands the aborted request's final output out
    expected = reference(tiny_models["qwen3"], prompts, 24)
    assert finished[ids[0]].token_ids == expected[0]
    assert finished[ids[2]].token_ids == expected[2]
    assert_clean(llm)


def test_abort_waiting_request(llm):
    engine = llm.engine
    rid = engine.add_request([5, 6, 7], GREEDY)
    assert engine.abort(rid)
    assert engine.has_unfinished_requests()  # its final output waits for step()
    (final,) = engine.step()
    assert final.request_id == rid and final.finish_reason == "abort" and final.token_ids == []
    assert not engine.has_unfinished_requests()


def _stop_string_spanning_tokens(llm, full):
    """A 3-character piece of the text that starts inside one token and ends in another."""
    tok = llm.tokenizer
    offsets = []
    for n in range(1, len(full.token_ids) + 1):
        offsets.append(len(tok.decode(full.token_ids[:n], skip_special_tokens=True)))
    for i in range(1, len(offsets) - 1):
        start = offsets[i] - 1
        stop = full.text[start : start + 3]
        if len(stop) == 3 and offsets[i] - offsets[i - 1] > 1 and full.text.find(stop) == start:
            return stop, start
    pytest.skip("no token-spanning stop string in this output")


def test_stop_string_across_token_boundary(llm):
    prompt = "Continuous batching schedules"
    (full,) = llm.generate([prompt], GREEDY)
    stop, where = _stop_string_spanning_tokens(llm, full)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    (cut,) = llm.generate([prompt], params)
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:where]
    assert stop not in cut.text
    deltas = list(llm.stream(prompt, params))
    assert "".join(d.new_text for d in deltas) == cut.text
    assert_clean(llm)


def test_stop_token_ids_and_eos(llm):
    (full,) = llm.generate([[10, 11, 12]], GREEDY)
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    (cut,) = llm.generate([[10, 11, 12]], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]))
    assert cut.finish_reason == "stop" and cut.token_ids == full.token_ids[: first + 1]


def test_metrics_are_filled_and_ordered(llm):
    system = random_prompts([40], seed=1)[0]
    llm.generate([system + [3]], GREEDY)
    (out,) = llm.generate([system + [4]], GREEDY)
    m = out.metrics
    assert m.first_scheduled_time >= m.arrival_time
    assert m.time_to_first_token > 0 and m.time_per_output_token > 0 and m.e2e_latency >= m.time_to_first_token
    assert m.num_output_tokens == 24
    assert m.num_cached_tokens == 40  # 5 full blocks of 8 came from the prefix cache


def test_a_request_reported_only_when_it_ends_has_its_metrics_when_aborted(llm):
    """A final-only request without stop strings keeps only its token times per step; aborted
    midway, its one output still counts its tokens and times its last one."""
    engine = llm.engine
    state = engine.prepare([5, 6, 7], GREEDY, final_only=True)
    request_id = engine.enqueue(state, claimed=True)
    for _ in range(6):
        engine.step()
    assert engine.take_output(request_id) is None
    engine.abort(request_id)
    out = engine.take_output(request_id)
    engine.release(request_id)
    m = out.metrics
    assert out.finish_reason == "abort" and len(out.token_ids) >= 4
    assert m.num_output_tokens == len(out.token_ids)
    assert m.first_token_time is not None and m.last_token_time > m.first_token_time


def test_background_engine_serves_many_threads(llm, reference, tiny_models):
    prompts = random_prompts([5, 17, 33, 8, 21, 40], seed=31)
    expected = reference(tiny_models["qwen3"], prompts, 24)
    results: dict[int, list[int]] = {}
    texts: dict[int, tuple[str, str]] = {}
    with llm.background() as bg:
        def client(i):
            stream = bg.submit(prompts[i], GREEDY)
            deltas = list(stream)
            results[i] = sum((d.new_token_ids for d in deltas), [])
            texts[i] = ("".join(d.new_text for d in deltas), deltas[-1].text)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        with pytest.raises(ValueError, match="max_model_len"):
            bg.submit([1] * 300, GREEDY)
        # An abandoned stream is aborted and its blocks come back.
        stream = bg.submit(prompts[0], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        it = iter(stream)
        next(it)
        it.close()
        done = bg.submit([7, 8], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)).result()
        assert done.finished
    assert [results[i] for i in range(len(prompts))] == expected
    assert all(a == b for a, b in texts.values())
    assert_clean(llm)


def test_background_shutdown_frees_unfinished_requests_and_refuses_new_ones(llm):
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    bg = llm.background()
    done = bg.submit([7, 8], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    cut = bg.submit([1, 2, 3], long)
    final = done.result()
    assert final.finished and done.result() is final  # a consumed stream ends at once
    assert list(done) == []
    bg.shutdown()
    assert cut.result().finish_reason == "abort"  # shutting down aborts it: its one final output
    with pytest.raises(RuntimeError, match="shut down"):
        bg.submit([1, 2], long)
    assert_clean(llm)  # the cut request's blocks came back


def test_background_submit_racing_shutdown_never_hangs(llm):
    """Submitters on other threads while the loop stops: each call returns or raises."""
    for _ in range(5):
        bg = llm.background()
        outcomes = []

        def submitter():
            for _ in range(20):
                try:
                    bg.submit([1, 2], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
                    outcomes.append("ok")
                except RuntimeError:
                    outcomes.append("refused")

        threads = [threading.Thread(target=submitter, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        bg.shutdown()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a submit hung"
        assert len(outcomes) == 60
    assert_clean(llm)
