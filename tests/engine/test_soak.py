"""Soak: thousands of short requests with random settings through `background()` from several
threads — read to the end, aborted midway, closed early, dropped unread, or refused — and at the
end no block is used, no request state is left anywhere in the engine, and the process's memory
has not grown."""

from __future__ import annotations

import gc
import random
import threading

import psutil
import pytest

from fastgen import LLM, SamplingParams

NUM_THREADS = 4
WARMUP_REQUESTS = 400
SOAK_REQUESTS = 8000
RSS_GROWTH_LIMIT = 32 << 20  # bytes; 8,000 requests grew it by under 1 MiB here
STOPS = [[], ["e"], ["the", "\n"], ["zz"]]


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.0, 1e-6, 0.8, 3.0e38]),
        top_k=rng.choice([-1, 1, 5, 2**63]),
        top_p=rng.choice([1.0, 0.5, 1e-46]),
        max_tokens=rng.randint(1, 8),
        ignore_eos=rng.random() < 0.5,
        seed=rng.choice([None, rng.randrange(2**64)]),
        stop=rng.choice(STOPS),
        stop_token_ids=rng.sample(range(384), rng.choice([0, 0, 1, 3])),
    )


def random_prompt(rng: random.Random):
    if rng.random() < 0.3:
        return rng.choice(["The quick brown fox", "Paged attention", "def f(x):", "Grüße 東京 🚀"])
    return [rng.randrange(1, 384) for _ in range(rng.randint(1, 24))]


def check_outputs(outputs, params: SamplingParams, aborted: bool) -> None:
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True], "exactly one final output, last"
    final = outputs[-1]
    assert sum((o.new_token_ids for o in outputs), []) == final.token_ids
    assert "".join(o.new_text for o in outputs) == final.text
    assert len(final.token_ids) <= params.max_tokens
    assert final.finish_reason in (("abort", "stop", "length") if aborted else ("stop", "length"))
    if final.finish_reason == "length":
        assert len(final.token_ids) == params.max_tokens


def client(bg, seed: int, count: int, errors: list) -> None:
    rng = random.Random(seed)
    try:
        for _ in range(count):
            params, prompt, kind = random_params(rng), random_prompt(rng), rng.random()
            if kind < 0.05:  # refused in this thread, the loop unharmed
                with pytest.raises(ValueError):
                    bg.submit([1] * 200, params)
                continue
            stream = bg.submit(prompt, params)
            if kind < 0.20:  # dropped unread: its finalizer aborts it
                del stream
            elif kind < 0.30:  # closed after its first output
                next(stream)
                stream.close()
            elif kind < 0.45:  # aborted midway, read to the end
                outputs = [next(stream)]
                bg.abort(stream.request_id)
                outputs += list(stream)
                check_outputs(outputs, params, aborted=True)
            else:
                check_outputs(list(stream), params, aborted=False)
    except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
        errors.append(exc)


def run_clients(bg, total: int, seed: int) -> None:
    errors: list = []
    threads = [threading.Thread(target=client, args=(bg, seed + i, total // NUM_THREADS, errors))
               for i in range(NUM_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a client hung"
    if errors:
        raise errors[0]


@pytest.mark.slow
def test_soak_through_background_leaves_nothing_behind(tiny_models):
    llm = LLM(tiny_models["qwen3"], dtype="float32", block_size=8, num_kv_blocks=96, max_model_len=128,
              max_num_seqs=16, max_num_batched_tokens=128)
    engine = llm.engine
    process = psutil.Process()
    with llm.background() as bg:
        run_clients(bg, WARMUP_REQUESTS, seed=0)
        gc.collect()
        rss_before = process.memory_info().rss
        run_clients(bg, SOAK_REQUESTS, seed=100)
        gc.collect()
        rss_after = process.memory_info().rss
    assert not bg.running
    assert not engine.requests and not engine.live.by_seq and not engine.has_unfinished_requests()
    assert not engine.outbox.mailboxes and not engine.outbox.for_step and not engine.outbox.between_steps
    assert not engine.scheduler.waiting and not engine.scheduler.running and not engine.scheduler.suspects
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.runner.sampler.request_generators and not engine.runner.inputs.block_table.row_of
    assert rss_after - rss_before < RSS_GROWTH_LIMIT, f"RSS grew by {(rss_after - rss_before) / 2**20:.1f} MiB"
