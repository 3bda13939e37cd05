"""The tensor-parallel engine for real: a spawned worker process, gloo, rank 0's step broadcast.
With tensor_parallel_size=2, greedy output equals transformers and tensor_parallel_size=1 token
for token (fp32), through prefix-cache hits, preemption and chunked prefill; generate, stream,
background and seeded sampling behave as on one device. One engine per family is shared by the
module (starting one spawns a process: seconds)."""

from __future__ import annotations

import pytest

from fastgen import LLM, SamplingParams
from tests.conftest import random_prompts
from tests.engine.test_prefix_caching_and_preemption import run_checked

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Room for about two sequences at once (preemption), chunks of 40 tokens (chunked prefill).
ENGINE_ARGS = dict(dtype="float32", block_size=8, max_model_len=72, num_kv_blocks=11, max_num_seqs=5,
                   max_num_batched_tokens=40)


# Qwen3 (q/k norm, GQA) in the default run; Llama and GPT-2 (learned positions, a tied LM head
# over the vocabulary shards, biases on row-parallel layers) in the slow one.
@pytest.fixture(scope="module", params=["qwen3", pytest.param("llama", marks=pytest.mark.slow),
                                        pytest.param("gpt2", marks=pytest.mark.slow)])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def tp2(tiny_models, family):
    # A step the ranks run out of step (mismatched collectives) fails in a minute, not five.
    llm = LLM(tiny_models[family], tensor_parallel_size=2, distributed_timeout_s=60, **ENGINE_ARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tp1(tiny_models, family):
    return LLM(tiny_models[family], **ENGINE_ARGS)


def test_tp2_greedy_equals_transformers_and_tp1_through_hits_and_preemption(tp2, tp1, tiny_models, family,
                                                                           reference):
    system = random_prompts([16], seed=41)[0]
    prompts = random_prompts([4, 19, 34, 10, 26, 1], seed=42, prefix=system) + random_prompts([45], seed=43)
    preemptions, hits = tp2.engine.scheduler.num_preemptions, tp2.engine.block_manager.num_hit_tokens
    outputs = [o.token_ids for o in run_checked(tp2, prompts, GREEDY)]
    assert tp2.engine.scheduler.num_preemptions > preemptions
    assert tp2.engine.block_manager.num_hit_tokens > hits
    assert outputs == reference(tiny_models[family], prompts, MAX_TOKENS)
    assert outputs == [o.token_ids for o in tp1.generate(prompts, GREEDY)]


def test_tp2_stream_and_background_give_the_generate_tokens(tp2, tiny_models, family, reference):
    prompts = random_prompts([7, 30], seed=44)
    expected = reference(tiny_models[family], prompts, MAX_TOKENS)
    streamed = sum((d.new_token_ids for d in tp2.stream(prompts[0], GREEDY)), [])
    assert streamed == expected[0]
    with tp2.background() as bg:
        streams = [bg.submit(p, GREEDY) for p in prompts]
        assert [s.result().token_ids for s in streams] == expected


def test_tp2_seeded_sampling_equals_tp1(tp2, tp1):
    prompts = random_prompts([5, 23], seed=45)
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=s, max_tokens=MAX_TOKENS, ignore_eos=True)
              for s in (1, 2)]
    assert [o.token_ids for o in tp2.generate(prompts, params)] == [o.token_ids for o in tp1.generate(prompts, params)]


def _logprob_table(positions) -> list[list[tuple[int, float]]]:
    return [[(token, lp.logprob) for token, lp in position.items()] for position in positions or [] if position]


def _assert_same_logprobs(got, want) -> None:
    got, want = _logprob_table(got), _logprob_table(want)
    assert [[t for t, _ in p] for p in got] == [[t for t, _ in p] for p in want]
    assert [lp for p in got for _, lp in p] == pytest.approx([lp for p in want for _, lp in p], abs=1e-4)


def test_tp2_forks_logprobs_and_prompt_logprobs_equal_tp1(tp2, tp1):
    """n > 1 forks copy KV blocks on every rank; prompt logprobs form logits over hidden-row
    spans, a collective each: both must run in step on the worker or the engine would hang."""
    prompts = random_prompts([9, 38], seed=46)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    got, want = tp2.generate(prompts, params), tp1.generate(prompts, params)
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        for gc, wc in zip(g.outputs, w.outputs):
            _assert_same_logprobs(gc.logprobs, wc.logprobs)
        _assert_same_logprobs(g.prompt_logprobs, w.prompt_logprobs)
        assert len(_logprob_table(g.prompt_logprobs)) == len(g.prompt_token_ids) - 1


def test_a_second_engine_is_refused_before_it_starts_a_worker_and_the_first_serves_on(tp2, tiny_models,
                                                                                     monkeypatch):
    from fastgen.distributed.supervisor import WorkerSupervisor

    def no_spawn(*args, **kwargs):
        raise AssertionError("a worker was started for an engine that is refused")

    monkeypatch.setattr(WorkerSupervisor, "spawn", no_spawn)
    with pytest.raises(RuntimeError, match="torch.distributed is already initialized"):
        LLM(tiny_models["qwen3"], tensor_parallel_size=2, **ENGINE_ARGS)
    assert len(tp2.generate([[1, 2, 3]], GREEDY)[0].token_ids) == MAX_TOKENS

