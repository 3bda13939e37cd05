"""The background loop: one loop per engine, streams that own their request (dropped unread, they
abort it), and exactly one final output per request, "abort" included."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from fastgen import LLM, SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["qwen3"], dtype="float32", block_size=8, num_kv_blocks=256, max_model_len=256)


def assert_clean(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.requests and not engine.outbox.mailboxes
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_one_engine_gets_one_loop(llm):
    bg = llm.background()
    try:
        with pytest.raises(RuntimeError, match="a background loop already drives this engine"):
            llm.background()
        assert bg.submit([1, 2, 3], SHORT).result().finish_reason == "length"  # the first loop is unharmed
    finally:
        bg.shutdown()
    with llm.background() as again:  # after shutdown, a new loop may start
        assert again.submit([1, 2, 3], SHORT).result().finish_reason == "length"
    assert_clean(llm)


def test_while_a_loop_runs_other_threads_cannot_drive_the_engine(llm):
    with llm.background() as bg:
        for call in (lambda: llm.generate([[1, 2]], SHORT), lambda: llm.stream([1, 2], SHORT),
                     lambda: llm.engine.add_request([1, 2], SHORT), llm.engine.step):
            with pytest.raises(RuntimeError, match="driven by a background loop"):
                call()
        assert bg.submit([4, 5], SHORT).result().finish_reason == "length"
    assert llm.generate([[1, 2]], SHORT)[0].finish_reason == "length"  # usable directly again


def test_a_loop_refuses_an_engine_with_requests_of_its_own(llm):
    stream = llm.stream([1, 2, 3], SHORT)
    with pytest.raises(RuntimeError, match="unfinished request"):
        llm.background()
    stream.close()
    with llm.background() as bg:
        assert bg.submit([1], SHORT).result().finished
    assert_clean(llm)


def test_an_aborted_stream_ends_with_one_final_abort_output(llm):
    with llm.background() as bg:
        stream = bg.submit([5, 6, 7], LONG)
        first = next(stream)
        bg.abort(stream.request_id)
        rest = list(stream)
        assert [o.finished for o in rest] == [False] * (len(rest) - 1) + [True]
        assert rest[-1].finish_reason == "abort" and len(rest[-1].token_ids) < 200
        assert stream.result().finish_reason == "abort"
        assert first.token_ids == rest[-1].token_ids[: len(first.token_ids)]
        bg.abort("no-such-request")  # unknown ids are a no-op
    assert_clean(llm)


@pytest.mark.parametrize("request_id", [5, None, ["bg-0"], {"id": 1}, ""])
def test_abort_takes_string_ids(llm, request_id):
    with llm.background() as bg:
        with pytest.raises(ValueError, match=r"request_id=.* must be a non-empty string"):
            bg.abort(request_id)


def test_a_stream_dropped_unread_aborts_its_request(llm, monkeypatch):
    aborted = []
    abort = llm.engine.abort

    def recording_abort(request_id):
        aborted.append(request_id)
        return abort(request_id)

    monkeypatch.setattr(llm.engine, "abort", recording_abort)
    with llm.background() as bg:
        stream = bg.submit([5, 6, 7], LONG)
        request_id = stream.request_id
        del stream
        gc.collect()
        deadline = time.monotonic() + 60
        while request_id not in aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert request_id in aborted, "the dropped stream's request ran on"
        assert bg.submit([1, 2], SHORT).result().finish_reason == "length"
    assert_clean(llm)


@pytest.mark.parametrize("when", ["before the loop takes it", "after the loop added it"])
def test_a_submit_interrupted_while_it_waits_leaves_no_request_running(llm, monkeypatch, when):
    """Ctrl-C in `submit` while it waits for the loop: no stream will read the request, so it is
    never added (the loop may still win that race), or aborted once it is."""
    import fastgen.engine.background as background

    class InterruptedWait(background.Future):
        """The submitter's first wait is interrupted (before the loop answers, or after it did)."""
        interrupted = False

        def result(self, timeout=None):
            if self.interrupted or when == "after the loop added it":
                value = super().result(timeout)
                if self.interrupted:
                    return value
            self.interrupted = True
            raise KeyboardInterrupt

    added, aborted = [], []
    add_request, abort = llm.engine.add_request, llm.engine.abort
    monkeypatch.setattr(llm.engine, "add_request", lambda *a, **k: added.append(add_request(*a, **k)) or added[-1])
    monkeypatch.setattr(llm.engine, "abort", lambda request_id: aborted.append(request_id) or abort(request_id))
    with llm.background() as bg:
        with monkeypatch.context() as m:
            m.setattr(background, "Future", InterruptedWait)
            with pytest.raises(KeyboardInterrupt):
                bg.submit([5, 6, 7], LONG)
        # Commands run in order, and an abort before the next step: once a later request has
        # finished, the interrupted one was skipped, or added and aborted.
        assert bg.submit([1, 2], SHORT).result().finish_reason == "length"
        interrupted = added[:-1]
        if when == "after the loop added it":
            assert interrupted, "the loop never added the request"
        assert all(request_id in aborted for request_id in interrupted), "the interrupted request ran on"
    assert_clean(llm)


def test_shutdown_ends_every_stream_with_its_final_output(llm):
    bg = llm.background()
    streams = [bg.submit([i + 1, 2, 3], LONG) for i in range(3)]
    next(streams[0])
    bg.shutdown()
    assert [s.result().finish_reason for s in streams] == ["abort"] * 3
    assert_clean(llm)


def test_abort_all_ends_every_stream_with_abort_and_the_loop_serves_on(llm):
    with llm.background() as bg:
        streams = [bg.submit([i + 1, 2, 3], LONG) for i in range(3)]
        next(streams[0])
        bg.abort_all()
        assert [s.result().finish_reason for s in streams] == ["abort"] * 3
        assert bg.running
        assert bg.submit([1, 2], SHORT).result().finish_reason == "length"
    assert_clean(llm)


def spy_encoding_threads(tokenizer, monkeypatch) -> list[str]:
    """Names of the threads that call `tokenizer.encode` from now on."""
    threads, encode = [], tokenizer.encode

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording)
    return threads


def test_text_prompts_are_tokenized_in_the_submitting_thread(llm, tiny_models, reference, monkeypatch):
    """The loop thread, which runs every stream's steps, never waits on a prompt's tokenization;
    the answer is transformers' for the tokens the engine's tokenizer gives."""
    text = "def fibonacci(n): return n " * 4
    ids = llm.tokenizer.encode(text)
    threads = spy_encoding_threads(llm.engine.tokenizer, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with llm.background() as bg:
        done = bg.submit(text, params).result()
        with pytest.raises(ValueError, match="prompt has .* characters: it cannot fit in max_model_len=256"):
            bg.submit("x" * 100_000, params)
        assert threads and set(threads) == {threading.current_thread().name} != {bg._thread.name}
    assert done.prompt == text and done.prompt_token_ids == ids
    assert done.token_ids == reference(tiny_models["qwen3"], [ids], 8)[0]
    assert_clean(llm)


def test_token_id_prompts_are_checked_in_the_submitting_thread(llm, tiny_models, reference, monkeypatch):
    """A long list of ids takes the loop milliseconds to check one by one: the submitting thread
    does it, and a bad id raises there."""
    from fastgen.engine import prompts

    threads, check = [], prompts.token_ids_of

    def recording(prompt):
        threads.append(threading.current_thread().name)
        return check(prompt)

    monkeypatch.setattr(prompts, "token_ids_of", recording)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with llm.background() as bg:
        done = bg.submit([5, 6, 7, 8], params).result()
        with pytest.raises(ValueError, match=r"prompt token_ids\[1\]=2.5 must be an integer"):
            bg.submit([1, 2.5], params)
        assert threads and set(threads) == {threading.current_thread().name}
    assert done.prompt is None and done.token_ids == reference(tiny_models["qwen3"], [[5, 6, 7, 8]], 8)[0]
    assert_clean(llm)
