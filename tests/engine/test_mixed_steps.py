"""Mixed steps: running sequences decode in the same step as prompt chunks, within one token
budget, and a long prompt's chunks are capped while streams run. Greedy output equals
transformers' whatever the mix: prompts arrive while others decode, at every chunk size."""

from __future__ import annotations

import pytest

from fastgen import LLM, SamplingParams
from fastgen.engine.block_manager import BlockManager
from fastgen.engine.scheduler import Scheduler
from fastgen.sequence import Sequence, SequenceStatus
from tests.conftest import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def scheduler(budget=64, threshold=0, num_blocks=64, block_size=4):
    return Scheduler(BlockManager(num_blocks, block_size), 8, budget, 256, eos_token_ids=[0],
                     long_prefill_token_threshold=threshold)


def step(s: Scheduler):
    out = s.schedule()
    s.postprocess(out, [7 if out.samples(i) else None for i in range(len(out.seqs))])
    return out


def prompt(seq_id: int, n: int) -> Sequence:
    tokens = [10 + (seq_id * 7 + i) % 90 for i in range(n)]
    return Sequence(seq_id, tokens, SamplingParams(max_tokens=20, ignore_eos=True))


def test_a_prompt_arriving_beside_a_stream_shares_its_steps_in_capped_chunks():
    s = scheduler(budget=64, threshold=8)
    stream = prompt(0, 5)
    s.add(stream)
    assert step(s).num_new_tokens == [5]  # alone: a plain prefill
    assert not step(s).is_prefill  # then a plain decode
    long = prompt(1, 30)
    s.add(long)
    counts = []
    while long.num_computed_tokens < 30:
        out = step(s)
        assert out.is_prefill and out.seqs[0] is stream and out.num_new_tokens[0] == 1  # the stream decodes first
        counts.append(out.num_new_tokens[1])
    assert counts == [8, 8, 8, 6]  # capped while the stream runs
    out = step(s)
    assert not out.is_prefill and out.seqs == [stream, long]


def test_a_stream_short_of_blocks_preempts_the_prompt_in_progress_beside_it():
    """Blocks run out in a mixed step: the newest running sequence not yet given its slot, here a
    half-computed prompt, goes back to the front of the queue; the stream decodes."""
    s = scheduler(budget=64, threshold=2, num_blocks=6, block_size=2)
    stream, long = prompt(0, 3), prompt(1, 8)
    s.add(stream)
    step(s)  # the stream's prompt: 2 blocks, its first token sampled
    s.add(long)
    out = step(s)
    assert out.is_prefill and out.num_decodes == 1 and out.num_new_tokens == [1, 2]  # long holds all 4 free blocks
    out = step(s)  # the stream's next token needs a block: none is free
    assert s.num_preemptions == 1 and long.status is SequenceStatus.WAITING and s.waiting[0] is long
    assert not out.is_prefill and out.seqs == [stream] and long.num_computed_tokens == 0
    s.block_manager.check_invariants(s.running)


def test_prompts_under_way_share_one_cap_beside_a_stream_and_the_shortest_goes_first():
    """While a stream decodes, a step carries at most `long_prefill_token_threshold` prompt
    tokens in all, however many prompts are under way; the prompt with the fewest tokens left
    takes them first, and a waiting prompt shorter than those under way is admitted first."""
    s = scheduler(budget=64, threshold=8)
    stream = prompt(0, 5)
    s.add(stream)
    step(s)
    step(s)  # the stream decodes

    def prompt_chunks(out):
        assert out.num_decodes >= 1 and out.num_prompt_tokens <= 8
        return [(sq.seq_id, n) for sq, n in zip(out.seqs[out.num_decodes:], out.num_new_tokens[out.num_decodes:])]

    long, other, short = prompt(1, 30), prompt(2, 20), prompt(3, 3)
    s.add(long)
    s.add(other)
    assert prompt_chunks(step(s)) == [(1, 8)]  # the queue's head, alone under way
    assert prompt_chunks(step(s)) == [(2, 8)]  # 20 tokens: fewer than long's 22 left
    s.add(short)
    assert prompt_chunks(step(s)) == [(3, 3), (2, 5)]  # short jumps both; other takes the rest
    assert prompt_chunks(step(s)) == [(2, 7), (1, 1)]
    assert [prompt_chunks(step(s)) for _ in range(3)] == [[(1, 8)], [(1, 8)], [(1, 5)]]
    assert all(sq.num_uncomputed_tokens == 1 for sq in (long, other, short))
    s.block_manager.check_invariants(s.running)


def test_a_long_prompt_is_not_held_back_for_good_by_short_arrivals():
    """Shortest first, but a prompt under way that capped steps passed over PASSED_OVER_LIMIT
    times in a row goes first; a preempted sequence whose blocks come back from the prefix cache
    counts only what it has left to compute."""
    from fastgen.engine.scheduler import PASSED_OVER_LIMIT

    s = scheduler(budget=64, threshold=4, num_blocks=256)
    stream = Sequence(0, [7, 8, 9], SamplingParams(max_tokens=200, ignore_eos=True))
    s.add(stream)
    step(s)
    step(s)
    long = prompt(1, 40)
    s.add(long)
    step(s)  # long admitted: 4 tokens
    served_long = []
    i = 0
    while long.num_uncomputed_tokens > 1:
        # A short arrival every step, taking the whole cap, done after its first token.
        s.add(Sequence(100 + i, [10 + i % 50] * 4, SamplingParams(max_tokens=1, ignore_eos=True)))
        out = step(s)
        assert out.num_decodes >= 1  # the stream decodes throughout: every step is capped
        served_long.append(long in out.seqs[out.num_decodes:])
        i += 1
    assert sum(served_long) >= 9  # 36 tokens left, at most 4 a step
    assert served_long[: PASSED_OVER_LIMIT + 1] == [False] * PASSED_OVER_LIMIT + [True]  # short ones first...
    for start in range(len(served_long) - PASSED_OVER_LIMIT):  # ...but never for longer than the limit
        assert any(served_long[start : start + PASSED_OVER_LIMIT + 1])
    s.block_manager.check_invariants(s.running)


def test_without_streams_a_long_prompt_takes_the_whole_budget():
    s = scheduler(budget=16, threshold=4)
    s.add(prompt(0, 40))
    assert [step(s).num_new_tokens for _ in range(3)] == [[16], [16], [8]]


def test_decode_tokens_count_against_the_budget():
    s = scheduler(budget=6, threshold=0)
    for i in range(3):
        s.add(prompt(i, 2))
    step(s)  # three 2-token prompts
    s.add(prompt(3, 10))
    out = step(s)
    assert out.num_new_tokens == [1, 1, 1, 3]  # three decodes leave 3 of the 6 tokens
    s.block_manager.check_invariants(s.running)


@pytest.mark.parametrize(("budget", "threshold", "compiled"), [
    (1, 0, False), (3, 1, False), (8, 2, False), (16, 5, False), (64, 0, False), (16, 5, True),
])
def test_prompts_arriving_while_others_decode_equal_transformers(tiny_models, reference, private_cache, budget,
                                                                 threshold, compiled):
    """Requests join one at a time while earlier ones decode, so steps mix decode rows with
    prompt chunks of every size the budget and cap allow (a budget of 1: a step is either one
    decode or one token of a prompt). Every output equals transformers' greedy continuation,
    eagerly and through the compiled CPU graphs (a mixed step runs the prefill graph)."""
    model = tiny_models["qwen3"]
    llm = LLM(model, dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8,
              max_num_batched_tokens=budget, long_prefill_token_threshold=threshold, max_model_len=128,
              enforce_eager=not compiled, compile_mode="blocking", compile_processes=1)
    engine = llm.engine
    prompts = random_prompts([7, 40, 3, 25, 1, 12], seed=33)
    kinds: set[str] = set()
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        if out is not None:
            kinds.add("mixed" if out.is_prefill and out.num_decodes else "prefill" if out.is_prefill else "decode")
        return out

    engine.scheduler.schedule = recording_schedule
    finals = {}
    ids = []
    for p in prompts:
        ids.append(engine.add_request(p, GREEDY))
        for _ in range(3):
            finals.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    for request_id, p in zip(ids, prompts):
        assert finals[request_id].token_ids == reference(model, [p], GREEDY.max_tokens)[0]
    assert ("mixed" in kinds) == (budget > 1)  # a one-token budget goes to a decode when there is one
    if compiled:
        assert {"layers", "head"} <= set(llm.engine.runner.compiled_decode.first_call_seconds)
        assert not llm.engine.runner.compiled_decode.failed
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
