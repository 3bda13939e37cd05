"""Speculative decoding in the engine: greedy output equals transformers' token for token in
float32 whatever the drafts (exact, wrong, none, cut by the budget or max_tokens), through mixed
steps, preemption, the prefix cache, stop tokens and strings, n > 1 and aborts; requests that
cannot be verified exactly decode as without speculation."""

from __future__ import annotations

import dataclasses

import pytest

from fastgen import LLM, SamplingParams
from tests.conftest import FAMILIES, random_prompts

MAX_TOKENS = 24
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=extra.pop("max_tokens", MAX_TOKENS), ignore_eos=True, **extra)


def corrupted(tokens: list[int], every: int = 7) -> list[int]:
    """The output with every `every`-th token changed: drafts right for a while, then wrong."""
    return [(t + 1) % 300 + 1 if i % every == every - 1 else t for i, t in enumerate(tokens)]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_drafts_equals_transformers(tiny_models, reference, family):
    prompts = random_prompts([9, 21, 6], seed=4) + [random_prompts([5], seed=9)[0] * 5]
    want = reference(tiny_models[family], prompts, MAX_TOKENS)
    llm = LLM(tiny_models[family], dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=96,
              speculative_config=NGRAM)
    params = [greedy(prediction=want[0]), greedy(prediction=corrupted(want[1])), greedy(), greedy()]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert outs[0].metrics.num_accepted_draft_tokens >= MAX_TOKENS // 2  # the drafts were in play
    assert outs[1].metrics.num_draft_tokens > outs[1].metrics.num_accepted_draft_tokens > 0
    stats = llm.engine.stats()
    assert stats.accepted_draft_tokens == sum(o.metrics.num_accepted_draft_tokens for o in outs)
    assert sum(stats.accepted_per_position) == stats.accepted_draft_tokens
    llm.engine.check_invariants()


def test_a_request_of_n_completions_counts_every_completions_drafts(tiny_models, reference):
    """Its metrics cover all completions, speculative decoding's counters too (the server's
    usage reports them)."""
    prompt = random_prompts([5], seed=9)[0] * 5  # repeats: the prompt lookup drafts
    llm = LLM(tiny_models["qwen3"], dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=96,
              speculative_config=NGRAM)
    (out,) = llm.generate([prompt], greedy(n=2))
    assert [c.token_ids for c in out.outputs] == reference(tiny_models["qwen3"], [prompt], MAX_TOKENS) * 2
    stats = llm.engine.stats()
    assert out.metrics.num_accepted_draft_tokens == stats.accepted_draft_tokens > 0
    assert out.metrics.num_draft_tokens == stats.draft_tokens
    assert out.metrics.accepted_per_position == list(stats.accepted_per_position)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_drafts_beside_prompt_chunks_and_within_a_small_budget(tiny_models, reference, k):
    """Long prompts arrive while drafted sequences decode: mixed steps with drafts, a token budget
    of 12 that cuts drafts and chunks prompts."""
    model = tiny_models["llama"]
    prompts = random_prompts([7, 40, 11, 33], seed=k)
    want = reference(model, prompts, MAX_TOKENS)
    llm = LLM(model, dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=96, max_num_batched_tokens=12,
              long_prefill_token_threshold=5, speculative_config=NGRAM | {"num_speculative_tokens": k})
    engine = llm.engine
    finals = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, greedy(prediction=want[i]), request_id=str(i))
        for _ in range(3):  # the others arrive while the first ones decode
            finals.update({o.request_id: o for o in engine.step() if o.finished})
            engine.check_invariants()
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    assert [finals[str(i)].token_ids for i in range(len(prompts))] == want
    stats = engine.stats()
    assert stats.mixed_steps > 0 and stats.accepted_draft_tokens > 0


def test_max_tokens_cuts_a_draft(tiny_models, reference):
    model = tiny_models["qwen3"]
    prompts = random_prompts([8, 13], seed=2)
    want = reference(model, prompts, 6)
    llm = LLM(model, dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=32, speculative_config=NGRAM)
    outs = llm.generate(prompts, [greedy(max_tokens=6, prediction=want[i] + [1, 2, 3]) for i in range(2)])
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there(tiny_models, reference):
    model = tiny_models["qwen2"]
    prompt = random_prompts([10], seed=6)[0]
    (want,) = reference(model, [prompt], MAX_TOKENS)
    stop = want[9]
    expected = want[: want.index(stop) + 1]
    llm = LLM(model, dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=32, speculative_config=NGRAM)
    (out,) = llm.generate([prompt], greedy(prediction=want, stop_token_ids=[stop]))
    assert out.token_ids == expected and out.finish_reason == "stop"
    assert out.metrics.num_accepted_draft_tokens > 0


def test_a_stop_string_completed_inside_drafts_ends_where_it_would_without_them(tiny_models, reference):
    model = tiny_models["llama"]
    prompt = random_prompts([12], seed=8)[0]
    (want,) = reference(model, [prompt], MAX_TOKENS)
    plain = LLM(model, dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=32)
    text = plain.generate([prompt], greedy())[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    expected = plain.generate([prompt], greedy(stop=[stop]))[0]
    spec = LLM(model, dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=32, speculative_config=NGRAM)
    (out,) = spec.generate([prompt], greedy(stop=[stop], prediction=want))
    assert (out.text, out.token_ids, out.finish_reason) == (expected.text, expected.token_ids, "stop")
    assert out.token_ids == want[: len(out.token_ids)] and len(out.token_ids) < MAX_TOKENS
    assert out.metrics.num_accepted_draft_tokens > 0


def test_drafted_tokens_a_stop_string_cuts_off_are_not_counted_as_kept(tiny_models, reference):
    """A stop string completed early in a long run of accepted drafts: the tokens after it are
    dropped, and the draft counters count only those the output kept."""
    model = tiny_models["llama"]
    prompt = random_prompts([9], seed=4)[0]
    (want,) = reference(model, [prompt], MAX_TOKENS)
    spec = LLM(model, dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=32,
               speculative_config=dict(NGRAM, num_speculative_tokens=8))
    spec.engine.drafter.row_cost = 0.0  # whole drafts of 8 from the first verify step on
    tokenizer = spec.engine.tokenizer
    cut = next(i for i in range(2, 6) if (piece := tokenizer.decode(want[: i + 1])[len(tokenizer.decode(want[:i])):])
               .strip() and piece not in tokenizer.decode(want[:i]) and "\ufffd" not in piece)
    stop = tokenizer.decode(want[: cut + 1])[len(tokenizer.decode(want[:cut])):]
    (out,) = spec.generate([prompt], greedy(stop=[stop], prediction=want))
    assert out.finish_reason == "stop" and out.token_ids == want[: cut + 1]
    # The first token is the prompt's; every later one came out of a verify step.
    assert 0 < out.metrics.num_accepted_draft_tokens <= cut
    assert sum(out.metrics.accepted_per_position) == out.metrics.num_accepted_draft_tokens
    assert spec.engine.stats().accepted_draft_tokens == out.metrics.num_accepted_draft_tokens


def test_preemption_and_the_prefix_cache_stay_exact(tiny_models, reference):
    """Few blocks: drafted sequences are preempted and recomputed; then prompts that extend the
    first answers reuse their keyed blocks, which must hold only accepted tokens."""
    model = tiny_models["qwen3"]
    prompts = random_prompts([14, 9, 17, 12], seed=10)
    want = reference(model, prompts, MAX_TOKENS)
    llm = LLM(model, dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=22, speculative_config=NGRAM)
    engine = llm.engine
    finals = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, greedy(prediction=corrupted(want[i], 5)), request_id=str(i))
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    assert [finals[str(i)].token_ids for i in range(4)] == want
    assert engine.stats().num_preemptions > 0 and engine.stats().accepted_draft_tokens > 0
    followups = [p + w[:10] for p, w in zip(prompts, want)]
    want_more = reference(model, followups, 8)
    hits = engine.stats().prefix_hit_tokens
    outs = llm.generate(followups, [greedy(max_tokens=8, prediction=w) for w in want_more])
    assert [o.token_ids for o in outs] == want_more
    assert engine.stats().prefix_hit_tokens > hits


def test_completions_fork_from_a_last_prompt_token_that_ran_with_drafts(tiny_models, reference):
    """A chunked prompt that leaves one token runs it as a decode row, with drafts after it; the
    n > 1 children start from that token's logits, not from a draft's."""
    model = tiny_models["qwen3"]
    prompt = random_prompts([9], seed=21)[0]
    prompt = prompt + [prompt[0]]  # its last token opens it too: the prompt lookup drafts after it
    (want,) = reference(model, [prompt], 4)
    llm = LLM(model, dtype="float32", max_model_len=64, block_size=16, num_kv_blocks=16, max_num_batched_tokens=9,
              speculative_config=dict(NGRAM, num_speculative_tokens=1))
    llm.engine.drafter.row_cost = 0.0  # draft whenever there is a match
    (out,) = llm.generate([prompt], greedy(n=2, max_tokens=4))
    assert [c.token_ids for c in out.outputs] == [want, want]
    assert llm.engine.stats().draft_tokens > 0


def test_parallel_completions_and_seeds(tiny_models, reference):
    model = tiny_models["gpt2"]
    prompt = random_prompts([6], seed=3)[0]
    (want,) = reference(model, [prompt], MAX_TOKENS)
    llm = LLM(model, dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=64, speculative_config=NGRAM)
    (out,) = llm.generate([prompt], greedy(n=2, prediction=want))
    assert [c.token_ids for c in out.outputs] == [want, want]
    # A seeded request samples each position from its seed and the position alone, so drafts
    # (kept or not, whatever else runs) change none of its tokens.
    plain = LLM(model, dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=64)
    sampled = SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, n=3, seed=7)
    (expected,) = plain.generate([prompt], sampled)
    # The first completion predicted: its drafts are kept; the others' mostly not.
    predicted = dataclasses.replace(sampled, prediction=expected.outputs[0].token_ids)
    (first,) = llm.generate([prompt], predicted)
    (beside,) = llm.generate([prompt, random_prompts([12], seed=5)[0]], predicted)[:1]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in expected.outputs]
    assert [c.token_ids for c in beside.outputs] == [c.token_ids for c in expected.outputs]
    assert llm.engine.stats().accepted_draft_tokens > 0


@pytest.mark.parametrize("params", [{"repetition_penalty": 1.3}, {"logprobs": 2}, {"min_tokens": MAX_TOKENS}],
                         ids=["penalty", "logprobs", "min_tokens"])
def test_requests_that_cannot_be_verified_exactly_decode_one_token_a_step(tiny_models, reference, params):
    model = tiny_models["llama"]
    prompt = random_prompts([9], seed=12)[0]
    plain = LLM(model, dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=32)
    expected = plain.generate([prompt], greedy(**params))[0]
    spec = LLM(model, dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=32, speculative_config=NGRAM)
    (out,) = spec.generate([prompt], greedy(prediction=expected.token_ids, **params))
    assert out.token_ids == expected.token_ids
    assert out.metrics.num_draft_tokens == 0
    if "logprobs" in params:
        assert [lp.keys() for lp in out.outputs[0].logprobs] == [lp.keys() for lp in expected.outputs[0].logprobs]


def test_an_abort_between_verifications_frees_everything(tiny_models, reference):
    model = tiny_models["qwen3"]
    prompts = random_prompts([8, 8], seed=13)
    want = reference(model, prompts, MAX_TOKENS)
    llm = LLM(model, dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=40, speculative_config=NGRAM)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, greedy(prediction=want[i]), request_id=str(i))
    finals = {}
    for _ in range(3):
        engine.step()
    assert engine.abort("0")
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    assert finals["0"].finish_reason == "abort" and finals["1"].token_ids == want[1]
    assert engine.stats().num_used_kv_blocks == 0 and not engine.drafter.seqs


def test_a_prediction_without_speculative_decoding_is_ignored_and_bad_ones_refused(tiny_models):
    model = tiny_models["llama"]
    llm = LLM(model, dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=32)
    (out,) = llm.generate([[5, 6, 7]], greedy(max_tokens=4, prediction="anything"))
    assert out.metrics.num_draft_tokens == 0
    spec = LLM(model, dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=32, speculative_config=NGRAM)
    with pytest.raises(ValueError, match=r"prediction\[1\]=100000 is outside the vocabulary \[0, 384\)"):
        spec.generate([[5, 6, 7]], greedy(prediction=[3, 100000]))
    with pytest.raises(ValueError, match=r"prediction=5 must be a string or a list of token ids"):
        SamplingParams(prediction=5)


def test_drafts_over_two_tensor_parallel_ranks(tiny_models, reference):
    from tests.distributed.thread_ranks import llm_on_thread_ranks

    model = tiny_models["qwen3"]
    prompts = random_prompts([11, 5], seed=14)
    want = reference(model, prompts, MAX_TOKENS)
    llm = llm_on_thread_ranks(model, 2, block_size=8, max_model_len=64, num_kv_blocks=64, speculative_config=NGRAM)
    outs = llm.generate(prompts, [greedy(prediction=corrupted(w)) for w in want])
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics.num_accepted_draft_tokens for o in outs) > 0


@pytest.mark.slow
def test_drafts_through_a_spawned_tensor_parallel_worker(tiny_models, reference):
    """Rank 0 broadcasts the verify steps (a row of logits a drafted position) to a real worker."""
    model = tiny_models["llama"]
    prompts = random_prompts([9, 14], seed=15)
    want = reference(model, prompts, MAX_TOKENS)
    with LLM(model, dtype="float32", tensor_parallel_size=2, distributed_timeout_s=60, block_size=8,
             max_model_len=64, num_kv_blocks=40, speculative_config=NGRAM | {"num_speculative_tokens": 6}) as llm:
        outs = llm.generate(prompts, [greedy(prediction=w) for w in want])
    assert [o.token_ids for o in outs] == want
    assert all(o.metrics.num_accepted_draft_tokens > 0 for o in outs)


@pytest.mark.slow
def test_verify_steps_through_the_compiled_cpu_graphs(tiny_models, reference):
    """Drafted steps run the compiled prefill graph (a row of logits a drafted position), plain
    steps the decode graph: the same tokens as transformers."""
    model = tiny_models["llama"]
    prompts = random_prompts([9, 20, 6], seed=16)
    want = reference(model, prompts, MAX_TOKENS)
    llm = LLM(model, dtype="float32", block_size=8, max_model_len=64, num_kv_blocks=64, enforce_eager=False,
              compile_mode="blocking", compile_processes=1, speculative_config=NGRAM)
    compiled = llm.engine.runner.compiled_decode
    assert compiled is not None
    outs = llm.generate(prompts, [greedy(prediction=want[0]), greedy(prediction=corrupted(want[1])), greedy()])
    assert [o.token_ids for o in outs] == want
    assert outs[0].metrics.num_accepted_draft_tokens > 0
    assert {"layers", "head"} <= set(compiled.first_call_seconds)


@pytest.mark.cuda
@pytest.mark.parametrize("max_num_seqs", [2, 16], ids=["some-drafts-eager", "every-draft-in-a-graph"])
def test_verify_steps_on_cuda_beside_the_decode_graphs(tiny_models, reference, max_num_seqs, monkeypatch):
    """On CUDA, drafted steps replay the verify graphs (laid out as decode rows, several a
    sequence) where one fits, and are verified eagerly where none does, while plain decode steps
    replay the decode graphs: the same tokens as transformers, drafts kept and rejected."""
    model = tiny_models["qwen3"]
    prompts = random_prompts([9, 20, 6], seed=16)
    want = reference(model, prompts, MAX_TOKENS)
    llm = LLM(model, device="cuda", dtype="float32", block_size=8, max_model_len=64, num_kv_blocks=64,
              max_num_seqs=max_num_seqs, cuda_graph_batch_sizes=[1, 2, 4, 8, 16], enforce_eager=False,
              speculative_config=NGRAM)
    engine = llm.engine
    assert engine.runner.graphs is not None and engine.runner.graphs.verify_sizes
    # Make every draft pay, so that verify and decode steps alternate whatever the costs.
    engine.drafter.threshold = lambda batch_size: 0.0
    replays = []
    replay = engine.runner.graphs.replay
    monkeypatch.setattr(engine.runner.graphs, "replay", lambda inputs: replays.append(
        inputs.meta.several_rows_a_sequence) or replay(inputs))
    outs = llm.generate(prompts, [greedy(prediction=want[0]), greedy(prediction=corrupted(want[1])), greedy()])
    assert True in replays and False in replays
    assert [o.token_ids for o in outs] == want
    assert outs[0].metrics.num_accepted_draft_tokens > 0
    assert outs[1].metrics.num_draft_tokens > outs[1].metrics.num_accepted_draft_tokens > 0
    engine.check_invariants()
