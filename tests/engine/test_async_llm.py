"""AsyncLLM: asyncio tasks share one engine loop; greedy text equals LLM.generate; a final-only
stream yields what a streamed request ends with; a cancelled task aborts its request and frees
its blocks; every request gets exactly one final output; max_waiting_requests refuses requests
beyond the cap at once."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fastgen import LLM, SamplingParams
from fastgen.engine import async_llm as async_llm_module
from fastgen.engine.async_llm import AsyncLLM
from fastgen.engine.requests import EngineOverloaded

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32", block_size=8, num_kv_blocks=256, max_model_len=512,
               max_waiting_requests=4)


def run(coro):
    return asyncio.run(coro)


def test_concurrent_tasks_get_the_same_greedy_tokens_as_generate(llm):
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14]]
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]

    async def one(async_llm, prompt):
        outputs = [o async for o in async_llm.generate_async(prompt, GREEDY)]
        finals = [o for o in outputs if o.finished]
        assert len(finals) == 1 and finals[0] is outputs[-1]
        assert [t for o in outputs for t in o.new_token_ids] == outputs[-1].token_ids
        return outputs[-1].token_ids

    async def main():
        async_llm = AsyncLLM(llm)
        try:
            return await asyncio.gather(*(one(async_llm, p) for p in prompts))
        finally:
            async_llm.shutdown()

    assert run(main()) == expected


def test_final_only_streams_yield_one_output_equal_to_the_streamed_requests_last(llm, tiny_models, reference):
    """The whole answer alone, for what a non-streamed HTTP response needs: the same tokens and
    text as the request streamed step by step, with a stop string, n > 1 and an abort too."""
    stop = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=["e"])
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, n=2)
    # Completions that end at different steps (a stop string each meets in its own time).
    staggered = SamplingParams(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True, n=3, stop=["a", "e"])
    prompts = [[5, 6, 7], [8, 9, 10, 11]]

    async def outputs(async_llm, prompt, params, final_only):
        return [o async for o in async_llm.generate_async(prompt, params, final_only=final_only)]

    greedy_finals = []

    async def main():
        async_llm = AsyncLLM(llm)
        try:
            for prompt in prompts:
                greedy_finals.append((await outputs(async_llm, prompt, GREEDY, True))[0].token_ids)
                for params in (GREEDY, stop, sampled, staggered):
                    streamed = await outputs(async_llm, prompt, params, False)
                    (final,) = await outputs(async_llm, prompt, params, True)
                    last = streamed[-1]
                    assert len(streamed) > 1 and final.finished
                    assert (final.text, final.token_ids, final.finish_reason) == (
                        last.text, last.token_ids, last.finish_reason)
                    assert final.new_token_ids == final.token_ids and final.new_text == final.text
                    assert [(c.text, c.token_ids, c.finish_reason) for c in final.outputs] == [
                        (c.text, c.token_ids, c.finish_reason) for c in last.outputs]
                    # The one output carries each completion whole, as what it adds.
                    assert all(c.new_token_ids == c.token_ids and c.new_text == c.text for c in final.outputs)
                    assert final.metrics.num_output_tokens == last.metrics.num_output_tokens
            stream = await async_llm.submit([1, 2, 3], LONG, final_only=True)
            await async_llm.abort(stream.request_id)
            assert [o.finish_reason async for o in stream] == ["abort"]
        finally:
            async_llm.shutdown()

    run(main())
    assert greedy_finals == reference(tiny_models["llama"], prompts, GREEDY.max_tokens)  # transformers' tokens


def test_a_steps_outputs_cross_to_the_event_loop_in_one_call(llm):
    """However many of its requests a step moves, the event loop is woken once for them."""
    prompts = [[5 + i, 6, 7] for i in range(4)]  # the module's engine lets 4 wait
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]

    async def main():
        loop = asyncio.get_running_loop()
        calls = []
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            if callback is async_llm_module._deliver:  # a batch of outputs
                calls.append(len(args[0]))
            return call_soon_threadsafe(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted
        async_llm = AsyncLLM(llm)
        steps_before = llm.engine.num_steps
        try:
            async def one(prompt):
                return [o async for o in async_llm.generate_async(prompt, GREEDY)]

            outputs = await asyncio.gather(*(one(p) for p in prompts))
        finally:
            async_llm.shutdown()
            loop.call_soon_threadsafe = call_soon_threadsafe
        return outputs, calls, llm.engine.num_steps - steps_before

    outputs, calls, steps = run(main())
    assert [o[-1].token_ids for o in outputs] == expected
    handed = sum(len(o) for o in outputs)
    assert handed >= len(prompts) * GREEDY.max_tokens  # an output a token, at least
    # Every output crossed in a batch, no more than one batch a step, and the steps that ran all
    # four requests handed their four outputs over together.
    assert sum(calls) == handed and len(calls) <= steps and max(calls) == len(prompts)


def test_a_failure_of_the_loop_itself_reaches_every_waiting_task(llm, monkeypatch):
    async def main():
        async_llm = AsyncLLM(llm)
        streams = [await async_llm.submit([1, 2, 3 + i], LONG) for i in range(2)]

        def broken_stats():
            raise RuntimeError("the loop's own bug")

        monkeypatch.setattr(llm.engine, "stats", broken_stats)
        try:
            for stream in streams:
                with pytest.raises(RuntimeError, match="the loop's own bug"):
                    async for _ in stream:
                        pass
        finally:
            async_llm.shutdown()
            monkeypatch.undo()

    run(main())
    assert not llm.engine.has_unfinished_requests()


def test_a_cancelled_task_aborts_its_request_and_frees_its_blocks(llm):
    async def main():
        async_llm = AsyncLLM(llm)
        try:
            started = asyncio.Event()

            async def reader():
                async for output in async_llm.generate_async([1, 2, 3], LONG):
                    started.set()

            task = asyncio.create_task(reader())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):  # the loop frees the blocks before its next step
                stats = async_llm.stats
                if stats.num_used_kv_blocks == 0 and stats.num_running == 0:
                    break
                await asyncio.sleep(0.01)
            assert async_llm.stats.num_used_kv_blocks == 0
        finally:
            async_llm.shutdown()

    run(main())
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_an_aborted_request_ends_with_one_abort_output(llm):
    async def main():
        async_llm = AsyncLLM(llm)
        try:
            stream = await async_llm.submit([1, 2, 3], LONG)
            first = await stream.__anext__()
            await async_llm.abort(stream.request_id)
            rest = [o async for o in stream]
            assert not first.finished and [o.finished for o in rest].count(True) == 1
            assert rest[-1].finish_reason == "abort"
        finally:
            async_llm.shutdown()

    run(main())


def test_a_bad_request_raises_in_the_awaiting_task_and_others_go_on(llm):
    async def main():
        async_llm = AsyncLLM(llm)
        try:
            with pytest.raises(ValueError, match="max_model_len"):
                await async_llm.submit([1] * 600, GREEDY)
            outputs = [o async for o in async_llm.generate_async([1, 2], GREEDY)]
            assert outputs[-1].finish_reason == "length"
        finally:
            async_llm.shutdown()

    run(main())


def test_requests_beyond_max_waiting_requests_are_refused_at_once(llm):
    engine = llm.engine
    ids = [engine.add_request([1, 2, 3], GREEDY) for _ in range(4)]  # the cap is 4
    with pytest.raises(EngineOverloaded, match="max_waiting_requests=4"):
        engine.add_request([1, 2, 3], GREEDY)
    assert len(engine.requests) == 4
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    engine.add_request([1, 2, 3], GREEDY)  # room again
    while engine.has_unfinished_requests():
        engine.step()


def test_tasks_cancelled_while_their_submit_waits_leave_the_loop_running(llm):
    """A task cancelled before the loop took its request adds nothing; one cancelled after is
    aborted once its id comes. Either way the loop, the other streams and the engine live on
    (the loop used to die setting the result of a cancelled future)."""
    expected = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids

    async def main():
        async_llm = AsyncLLM(llm)
        try:
            busy = await async_llm.submit([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
            for delay in (0, 0, 0, 0.001, 0.005):
                tasks = [asyncio.ensure_future(async_llm.submit([5, 6, 7], GREEDY)) for _ in range(3)]
                await asyncio.sleep(delay)
                for task in tasks:
                    task.cancel()
                for result in await asyncio.gather(*tasks, return_exceptions=True):
                    if not isinstance(result, BaseException):  # accepted before the cancel: its stream ends
                        assert [o async for o in result][-1].finished
            busy_outputs = [o async for o in busy]
            (after,) = [o async for o in async_llm.generate_async([5, 6, 7], GREEDY) if o.finished]
            assert async_llm.running
            return busy_outputs[-1].finish_reason, after.token_ids
        finally:
            async_llm.shutdown()

    assert run(main()) == ("length", expected)
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids == expected  # the loop gave the engine back


def test_long_text_prompts_are_tokenized_off_the_event_loop(llm, tiny_models, reference, monkeypatch):
    """A long prompt's tokenization would hold every other task of the event loop (a server's
    streams): it runs in a worker thread, a short one where it is submitted, and never in the
    engine's loop thread; the answers are transformers' for the engine tokenizer's tokens."""
    short = "def fibonacci(n): "
    long = "fibonacci " * 101
    assert len(short) <= async_llm_module.TOKENIZE_INLINE_MAX_CHARS < len(long)
    ids = {text: llm.tokenizer.encode(text) for text in (short, long)}
    threads = []
    encode = llm.engine.tokenizer.encode

    def recording(*args, **kwargs):
        threads.append(threading.current_thread())
        return encode(*args, **kwargs)

    monkeypatch.setattr(llm.engine.tokenizer, "encode", recording)

    async def main():
        async_llm = AsyncLLM(llm)
        try:
            finals = {}
            for text in (short, long):
                threads.clear()
                async for output in async_llm.generate_async(text, GREEDY):
                    finals[text] = output
                assert len(threads) == 1 and threads[0] is not async_llm.background._thread
                assert (threads[0] is threading.current_thread()) == (text is short)
            return finals
        finally:
            async_llm.shutdown()

    finals = run(main())
    for text, final in finals.items():
        assert final.prompt == text and final.prompt_token_ids == ids[text]
        assert final.token_ids == reference(tiny_models["llama"], [ids[text]], GREEDY.max_tokens)[0]
