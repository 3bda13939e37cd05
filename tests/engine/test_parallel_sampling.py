"""n > 1: one prefill, n completions forked from it (full blocks shared, the partial last block
copied), outputs in vLLM's shape, reproducible with a seed, through preemption and abort."""

from __future__ import annotations

import pytest

from fastgen import LLM, SamplingParams
from tests.conftest import random_prompts

MAX_TOKENS = 16


def make_llm(model: str, **kwargs) -> LLM:
    args = dict(dtype="float32", block_size=8, num_kv_blocks=256, max_model_len=256)
    return LLM(model, **{**args, **kwargs})


def assert_clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.requests and not engine.parents
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["qwen3"]


@pytest.mark.parametrize("prompt_len,engine_args", [
    (13, {}),  # a partial last block, copied
    (16, {}),  # no partial block
    (13, dict(max_num_batched_tokens=12)),  # the prompt's last token, and the fork, in a decode step
    (13, dict(enable_prefix_caching=False)),
])
def test_greedy_completions_all_equal_transformers(model, reference, prompt_len, engine_args):
    """Each forked child decodes from the parent's KV: any wrong shared or copied block would
    make its greedy continuation leave transformers'."""
    llm = make_llm(model, **engine_args)
    prompt = random_prompts([prompt_len], seed=prompt_len)[0]
    (out,) = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    expected = reference(model, [prompt], MAX_TOKENS)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == expected and c.finish_reason == "length" for c in out.outputs)
    assert out.token_ids == expected and out.finish_reason == "length" and out.finished
    assert_clean(llm)


def test_the_prompt_is_computed_once_and_its_full_blocks_shared(model):
    llm = make_llm(model)
    engine = llm.engine
    prompt = random_prompts([21], seed=4)[0]  # two full blocks of 8 and a partial one
    engine.add_request(prompt, SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    first = engine.run_step()
    assert first.is_prefill and first.num_tokens == len(prompt) and first.num_sampled == 4
    seqs = engine.scheduler.running
    assert len(seqs) == 4
    shared = seqs[0].block_table[:2]
    assert all(s.block_table[:2] == shared for s in seqs)
    assert all(engine.block_manager.blocks[b].ref_count == 4 for b in shared)
    assert len({s.block_table[2] for s in seqs}) == 4  # each its own copy of the partial block
    computed = first.num_tokens
    while engine.scheduler.has_unfinished():
        step = engine.run_step()
        assert not step.is_prefill
        computed += step.num_tokens
    assert [o.finished for o in engine.step()].count(True) == 1  # the request's one final output
    assert computed == len(prompt) + 4 * (MAX_TOKENS - 1)
    assert_clean(llm)


def test_seeded_n_is_reproducible_and_its_completions_distinct(model):
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = random_prompts([11], seed=5)[0]
    llm = make_llm(model)
    (a,) = llm.generate([prompt], params)
    (b,) = llm.generate([prompt], params)  # again, the prompt's blocks now cached
    (c,) = make_llm(model, seed=99).generate([prompt], params)  # another engine seed
    runs = [[o.token_ids for o in out.outputs] for out in (a, b, c)]
    assert runs[0] == runs[1] == runs[2]
    assert len({tuple(t) for t in runs[0]}) == 4
    assert_clean(llm)


def test_children_without_a_seat_start_later_with_the_same_tokens(model, reference):
    """max_num_seqs=2: two children fork, two wait and come in through the prefix cache; a tight
    cache preempts children too. Seeded completions are the same as with room for all."""
    prompt = random_prompts([19], seed=6)[0]
    # Penalties too: a preempted child's token counts are refilled from its tokens.
    sampled = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True,
                             presence_penalty=0.6, frequency_penalty=0.3)
    greedy = SamplingParams(n=4, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (roomy,) = make_llm(model).generate([prompt], sampled)
    for kwargs in (dict(max_num_seqs=2), dict(num_kv_blocks=10, max_model_len=40)):
        llm = make_llm(model, **kwargs)
        (tight,) = llm.generate([prompt], sampled)
        assert [o.token_ids for o in tight.outputs] == [o.token_ids for o in roomy.outputs]
        (out,) = llm.generate([prompt], greedy)
        assert all(o.token_ids == reference(model, [prompt], MAX_TOKENS)[0] for o in out.outputs)
        assert_clean(llm)
    assert llm.engine.scheduler.num_preemptions > 0


def test_each_completion_stops_on_its_own(model):
    llm = make_llm(model)
    prompt = random_prompts([9], seed=8)[0]
    (free,) = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True))
    stop = free.outputs[1].token_ids[2]
    (out,) = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True, stop_token_ids=[stop]))
    for before, after in zip(free.outputs, out.outputs):
        cut = before.token_ids.index(stop) + 1 if stop in before.token_ids else len(before.token_ids)
        assert after.token_ids == before.token_ids[:cut]
        assert after.finish_reason == ("stop" if stop in before.token_ids else "length")
    assert out.metrics.num_output_tokens == sum(len(o.token_ids) for o in out.outputs)
    assert_clean(llm)


def test_stream_carries_every_completions_deltas(model):
    llm = make_llm(model)
    prompt = "The quick brown fox"
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    (full,) = llm.generate([prompt], params)
    deltas = list(llm.stream(prompt, params))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    for i, completion in enumerate(full.outputs):
        assert "".join(d.outputs[i].new_text for d in deltas) == completion.text
        assert sum((d.outputs[i].new_token_ids for d in deltas), []) == completion.token_ids
        assert deltas[-1].outputs[i].text == completion.text
        streamed = deltas[-1].outputs[i]
        assert sum((d.outputs[i].new_logprobs for d in deltas), []) == streamed.logprobs
        assert [next(iter(e)) for e in streamed.logprobs] == completion.token_ids
    assert_clean(llm)


def test_background_engine_streams_n_completions(model):
    llm = make_llm(model)
    params = SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=MAX_TOKENS, ignore_eos=True)
    (expected,) = llm.generate(["Paged attention keeps"], params)
    with llm.background() as bg:
        final = bg.submit("Paged attention keeps", params).result()
    assert [o.token_ids for o in final.outputs] == [o.token_ids for o in expected.outputs]
    assert_clean(llm)


def test_abort_ends_every_completion_and_frees_their_blocks(model):
    llm = make_llm(model, max_num_batched_tokens=16)
    engine = llm.engine
    prompt = random_prompts([40], seed=9)[0]  # three prefill chunks: children still waiting
    params = SamplingParams(n=3, temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for steps in (1, 5):  # children waiting to fork; forked and decoding
        request_id = engine.add_request(prompt, params)
        for _ in range(steps):
            engine.step()
        if steps == 5:
            assert len(engine.scheduler.running) == 3
        assert engine.abort(request_id) and not engine.abort(request_id)
        (final,) = engine.step()  # one final output of the request, every completion aborted
        assert final.request_id == request_id and final.finished
        assert [c.finish_reason for c in final.outputs] == ["abort"] * 3
        assert_clean(llm)
