"""Structured outputs through the engine: greedy outputs equal transformers' under the same
grammar (xgrammar's logits processor for transformers), in mixed batches, mixed steps and under
preemption; sampled outputs always follow their grammar; bad specs are refused before queueing."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from fastgen import LLM, SamplingParams
from fastgen.structured_outputs_params import StructuredOutputsParams
from tests.conftest import random_prompts
from tests.structured.grammar_reference import hf_constrained_greedy, matches_grammar

xgr = pytest.importorskip("xgrammar")  # absent on the GPU machine; a setup dependency everywhere else

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age"]}
SPECS = {
    "json": StructuredOutputsParams(json=PERSON),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"[a-z]{2,6}-\d{1,3}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "it depends"]),
    "grammar": StructuredOutputsParams(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [0-9]+ | "x"'),
}
MAX_TOKENS = 24


def _greedy(spec):
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_constrained_greedy_equals_transformers_in_a_mixed_batch(tiny_models, family):
    model = tiny_models[family]
    specs = [SPECS["json"], None, SPECS["regex"], SPECS["choice"], SPECS["grammar"], SPECS["json_object"]]
    prompts = random_prompts([5, 9, 3, 12, 7, 4], seed=3)
    outs = LLM(model, dtype="float32").generate(prompts, [_greedy(s) for s in specs])
    expected = hf_constrained_greedy(model, prompts, specs, MAX_TOKENS)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # The choice and regex grammars are short: they end on their own, with "stop".
    assert outs[2].finish_reason == "stop" and outs[3].finish_reason == "stop"
    assert outs[3].outputs[0].text in SPECS["choice"].choice


def test_constrained_requests_arriving_while_others_decode_and_under_preemption(tiny_models):
    """Small token budgets and prefill chunks make mixed steps; few KV blocks make preemptions."""
    model = tiny_models["qwen3"]
    specs = [SPECS["json"], SPECS["grammar"], None, SPECS["regex"], SPECS["json"]]
    prompts = random_prompts([14, 6, 11, 9, 17], seed=5)
    llm = LLM(model, dtype="float32", max_num_batched_tokens=8, long_prefill_token_threshold=3, block_size=4,
              num_kv_blocks=12, max_num_seqs=4, max_model_len=48)
    engine = llm.engine
    ids = []
    for prompt, spec in zip(prompts, specs):
        ids.append(engine.add_request(prompt, _greedy(spec)))
        engine.step()
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats().mixed_steps > 0
    assert [finals[i].token_ids for i in ids] == hf_constrained_greedy(model, prompts, specs, MAX_TOKENS)
    assert engine.structured.num_matchers == 0  # every matcher released with its request


def test_sampled_outputs_follow_their_grammar_with_n_and_penalties(tiny_models):
    model = tiny_models["qwen3"]
    llm = LLM(model, dtype="float32")
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model), vocab_size=384, stop_token_ids=[0])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    prompts = random_prompts([6, 4, 8], seed=11)
    for name, spec in SPECS.items():
        params = SamplingParams(temperature=1.3, top_p=0.95, n=3, seed=7, max_tokens=MAX_TOKENS, presence_penalty=0.5,
                                repetition_penalty=1.2, structured_outputs=spec)
        for output in llm.generate(prompts, params):
            for completion in output.outputs:
                complete = completion.finish_reason == "stop"
                assert matches_grammar(compiler, spec, completion.token_ids, complete), (name, completion.text)
                if complete and name == "choice":
                    assert completion.text in spec.choice


def test_the_grammar_decides_where_the_output_ends(tiny_models):
    """ignore_eos does not outlast a complete grammar, min_tokens does not ban its end, and a
    grammar that cannot finish within max_tokens ends with "length"."""
    llm = LLM(tiny_models["qwen3"], dtype="float32")
    prompt = random_prompts([5], seed=2)[0]
    choice = SPECS["choice"]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=15,
                                              structured_outputs=choice))[0]
    assert out.finish_reason == "stop" and out.outputs[0].text in choice.choice
    # The same output with max_tokens its length: the last allowed token (EOS, ignore_eos or
    # not) completes the grammar, so the output is whole, not cut.
    for ignore_eos in (False, True):
        exact = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=len(out.outputs[0].token_ids),
                                                    ignore_eos=ignore_eos, structured_outputs=choice))[0]
        assert (exact.outputs[0].token_ids, exact.finish_reason) == (out.outputs[0].token_ids, "stop")
    long = StructuredOutputsParams(regex=r"a{40}")
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, structured_outputs=long))[0]
    assert out.finish_reason == "length" and set(out.outputs[0].text) <= {"a"}


@pytest.mark.parametrize("spec, field", [
    (StructuredOutputsParams(json={"type": "nonsense"}), "structured_outputs.json"),
    (StructuredOutputsParams(regex="(("), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"if": {"type": "string"}}}}),
     "structured_outputs.json.properties.a.if"),
    # no output follows it: its request failed at its first step, with a message that blamed the engine
    (StructuredOutputsParams(regex=r"[^\s\S]"), "structured_outputs.regex admits no output"),
    (StructuredOutputsParams(regex=r"a^b"), "structured_outputs.regex: the anchor '\\^' at position 1"),
    (StructuredOutputsParams(json={"type": "object", "required": ["a"], "additionalProperties": False}),
     "structured_outputs.json.required names 'a'"),
])
def test_a_spec_that_cannot_be_compiled_is_refused_before_anything_runs(tiny_models, spec, field):
    llm = LLM(tiny_models["qwen3"], dtype="float32")
    good = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        llm.generate([[5, 6], [7, 8]], [good, SamplingParams(max_tokens=4, structured_outputs=spec)])
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([5, 6], good)[0].finish_reason in ("stop", "length")


def test_compiled_once_per_distinct_spec_and_held_by_the_request(tiny_models):
    """A schema's property order is its own spec (the grammar writes properties in that order);
    the same spec is compiled once, and a request keeps its grammar when the cache lets it go."""
    llm = LLM(tiny_models["qwen3"], dtype="float32")
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    ba = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    llm.generate([[5, 6]] * 3, [SamplingParams(max_tokens=3, structured_outputs={"json": s}) for s in (ab, ba, ab)])
    stats = llm.engine.structured.stats
    assert stats.compiles == 2 and stats.cache_hits == 1 and stats.compile_seconds > 0
    engine = llm.engine
    engine.add_request([5, 6], _greedy(SPECS["json"]))
    compiled = stats.compiles
    engine.structured._grammars.clear()  # evicted while the request waits
    while engine.has_unfinished_requests():
        engine.step()
    assert stats.compiles == compiled  # nothing compiled during its steps


def test_a_schema_edited_after_the_request_was_added_changes_nothing(tiny_models):
    model = tiny_models["qwen3"]
    schema = {"type": "object", "properties": {"x": {"enum": ["left", "right"]}}, "required": ["x"]}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs={"json": schema})
    engine = LLM(model, dtype="float32").engine
    request_id = engine.add_request([9, 8, 7], params)
    schema["properties"]["x"]["enum"] = ["up"]
    finals = [o for _ in range(200) for o in engine.step() if o.finished]
    (final,) = finals
    assert final.request_id == request_id
    expected = hf_constrained_greedy(model, [[9, 8, 7]], [StructuredOutputsParams(json={
        "type": "object", "properties": {"x": {"enum": ["left", "right"]}}, "required": ["x"]})], MAX_TOKENS)
    assert final.token_ids == expected[0]


def test_greedy_forks_each_equal_transformers_and_aborts_release_their_matchers(tiny_models):
    model = tiny_models["llama"]
    prompt = random_prompts([7], seed=9)[0]
    llm = LLM(model, dtype="float32")
    (out,) = llm.generate(prompt, SamplingParams(temperature=0, n=3, max_tokens=MAX_TOKENS,
                                                 structured_outputs=SPECS["grammar"]))
    (expected,) = hf_constrained_greedy(model, [prompt], [SPECS["grammar"]], MAX_TOKENS)
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    engine = llm.engine
    ids = [engine.add_request(p, _greedy(SPECS["json"])) for p in random_prompts([5, 6], seed=4)]
    engine.step()
    engine.step()
    assert engine.structured.num_matchers == 2
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    assert engine.structured.num_matchers == 0 and not engine.has_unfinished_requests()


def test_structured_outputs_need_the_tokenizer(tiny_models):
    llm = LLM(tiny_models["qwen3"], dtype="float32", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate([5, 6], SamplingParams(structured_outputs={"regex": "a+"}))
