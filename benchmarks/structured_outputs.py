"""Structured outputs on the default model (or any `--model`): validity, overhead, compile time.

- validity: each schema of a suite (objects, enums, arrays with bounds, patterns, nesting,
  numbers with ranges, unions, references) is asked for in a chat prompt that shows it, greedy
  and sampled; an output is valid when it ended on its own ("stop"), parses as JSON and passes
  `jsonschema.validate`. Cut by max_tokens counts as invalid.
- overhead: the decode step time of a batch of 16 requests that all follow a schema against the
  same 16 prompts unconstrained, rounds in turn, only steps where all 16 decode (median).
- compile: each schema's grammar compile time, the first time it is seen.

Usage: python benchmarks/structured_outputs.py [--model PATH] [--max-tokens N] [--rounds R]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema

from fastgen import LLM, SamplingParams, StructuredOutputsParams
from fastgen.engine.prompts import chat_token_ids

NAME = {"type": "string", "minLength": 1, "maxLength": 40}
SUITE: dict[str, dict] = {
    "person": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                                     "maximum": 120}},
               "required": ["name", "age"]},
    "enum_color": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "bool_flag": {"type": "object", "properties": {"is_capital": {"type": "boolean"}, "city": NAME},
                  "required": ["is_capital", "city"]},
    "number_range": {"type": "object", "properties": {"temperature_c": {"type": "number", "minimum": -50,
                                                                        "maximum": 60}},
                     "required": ["temperature_c"]},
    "int_bounds": {"type": "object", "properties": {"score": {"type": "integer", "exclusiveMinimum": 0,
                                                              "exclusiveMaximum": 11}}, "required": ["score"]},
    "string_list": {"type": "object", "properties": {"fruits": {"type": "array", "items": NAME, "minItems": 2,
                                                                "maxItems": 4}}, "required": ["fruits"]},
    "int_list": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 100}, "minItems": 3,
                 "maxItems": 5},
    "pattern_code": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
                     "required": ["code"]},
    "pattern_date": {"type": "object", "properties": {"date": {"type": "string",
                                                               "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
                     "required": ["date"]},
    "nested_address": {"type": "object", "properties": {
        "name": NAME, "address": {"type": "object", "properties": {"street": NAME, "city": NAME,
                                                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                  "required": ["street", "city", "zip"]}}, "required": ["name", "address"]},
    "array_of_objects": {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                                                    "items": {"type": "object", "properties": {
                                                                        "name": NAME, "price": {"type": "number",
                                                                                                "minimum": 0}},
                                                                        "required": ["name", "price"]}}},
                         "required": ["items"]},
    "optional_fields": {"type": "object", "properties": {"title": NAME, "subtitle": NAME, "year": {
        "type": "integer", "minimum": 1900, "maximum": 2030}}, "required": ["title"]},
    "nullable": {"type": "object", "properties": {"middle_name": {"anyOf": [NAME, {"type": "null"}]}},
                 "required": ["middle_name"]},
    "union": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string",
                                                                                         "maxLength": 20}]}},
              "required": ["value"]},
    "const": {"type": "object", "properties": {"version": {"const": "1.0"}, "ok": {"type": "boolean"}},
              "required": ["version", "ok"]},
    "enum_list": {"type": "object", "properties": {"days": {"type": "array", "items": {
        "enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]}, "minItems": 1, "maxItems": 7}}, "required": ["days"]},
    "defs_ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                     "required": ["x", "y"]}},
                 "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
                 "required": ["start", "end"]},
    "deep_nesting": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}}, "required": ["b"]}},
                     "required": ["a"]},
    "string_bounds": {"type": "object", "properties": {"tweet": {"type": "string", "minLength": 10, "maxLength": 80}},
                      "required": ["tweet"]},
    "tuple": {"type": "array", "prefixItems": [NAME, {"type": "integer"}, {"type": "boolean"}], "items": False,
              "minItems": 3},
    "recipe": {"type": "object", "properties": {"title": NAME, "servings": {"type": "integer", "minimum": 1,
                                                                            "maximum": 12},
                                                "ingredients": {"type": "array", "items": NAME, "minItems": 2,
                                                                "maxItems": 6},
                                                "vegetarian": {"type": "boolean"}},
               "required": ["title", "servings", "ingredients", "vegetarian"]},
    "sentiment": {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                                   "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
                  "required": ["label", "confidence"]},
    "email_like": {"type": "object", "properties": {"email": {"type": "string",
                                                              "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"}},
                   "required": ["email"]},
    "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2},
}
ASKS = {
    "person": "Describe a fictional person.", "enum_color": "What color is the sky on a clear day?",
    "bool_flag": "Is Paris the capital of France?", "number_range": "What is a typical summer temperature in Rome?",
    "int_bounds": "Rate the movie Jaws from 1 to 10.", "string_list": "Name a few fruits.",
    "int_list": "Give me some lottery numbers.", "pattern_code": "Invent an airport-style code.",
    "pattern_date": "When did the Berlin wall fall?", "nested_address": "Invent a person and their address.",
    "array_of_objects": "List items on a grocery receipt.", "optional_fields": "Describe a famous film.",
    "nullable": "Does Barack Obama have a middle name?", "union": "What is the answer to life, the universe and "
    "everything?", "const": "Report the API status.", "enum_list": "Which days are weekend days?",
    "defs_ref": "Give a line segment on a plane.", "deep_nesting": "Fill in the nested value.",
    "string_bounds": "Write a short tweet about coffee.", "tuple": "Give a name, an age and whether they are a student.",
    "recipe": "Give me a pancake recipe.", "sentiment": "Classify: 'I loved this phone!'",
    "email_like": "Invent an email address.", "matrix": "Give a 2x2 matrix of digits.",
}


def chat_prompt(llm: LLM, name: str) -> list[int]:
    text = f"{ASKS[name]} Answer with JSON matching this schema: {json.dumps(SUITE[name])}"
    return chat_token_ids(llm.tokenizer, [{"role": "user", "content": text}])


def valid(output, schema: dict) -> bool:
    if output.finish_reason != "stop":
        return False
    try:
        jsonschema.validate(json.loads(output.outputs[0].text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def validity(llm: LLM, max_tokens: int, sampled: bool) -> dict:
    names = list(SUITE)
    params = [SamplingParams(temperature=0.8 if sampled else 0.0, top_p=0.95, seed=i if sampled else None,
                             max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=SUITE[name]))
              for i, name in enumerate(names)]
    outputs = llm.generate([chat_prompt(llm, name) for name in names], params)
    per_schema = {name: {"valid": valid(out, SUITE[name]), "finish_reason": out.finish_reason,
                         "tokens": len(out.outputs[0].token_ids), "text": out.outputs[0].text}
                  for name, out in zip(names, outputs)}
    return {"valid": sum(r["valid"] for r in per_schema.values()), "total": len(names), "schemas": per_schema}


def decode_step_times(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[float]:
    """Wall time of every decode step in which all the requests decode."""
    engine = llm.engine
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    times = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        result = engine.run_step()
        if result.is_prefill is False and result.num_seqs == len(prompts):
            times.append(time.perf_counter() - started)
        engine.outbox.take_for_step()
    return times


def overhead(llm: LLM, rounds: int, max_tokens: int) -> dict:
    """Each request asks for a list of 8 of its schema's values, so that all 16 keep decoding for
    max_tokens steps (a single value of the shorter schemas ends within a few tokens)."""
    names = list(SUITE)[:16]
    prompts = [chat_prompt(llm, name) for name in names]
    constrained = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                  structured_outputs=StructuredOutputsParams(json={
                                      "type": "array", "items": SUITE[name], "minItems": 8, "maxItems": 8}))
                   for name in names]
    free = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) for _ in names]
    runs = {"constrained": [], "unconstrained": []}
    for _ in range(rounds):
        for kind, params in (("unconstrained", free), ("constrained", constrained)):
            times = decode_step_times(llm, prompts, params)
            runs[kind].append({"steps": len(times), "median_ms": statistics.median(times) * 1e3 if times else None})
    medians = {kind: statistics.median(r["median_ms"] for r in rs if r["median_ms"]) for kind, rs in runs.items()}
    return {"batch": len(names), "rounds": runs, "median_step_ms": medians,
            "ratio": medians["constrained"] / medians["unconstrained"]}


def compile_times(llm: LLM) -> dict[str, float]:
    manager = llm.engine.structured
    times = {}
    for name, schema in SUITE.items():
        started = time.perf_counter()
        manager.compile(StructuredOutputsParams(json=schema))
        times[name] = (time.perf_counter() - started) * 1e3
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=2, help="overhead rounds, each kind in turn")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    llm = LLM(args.model, compile_mode="blocking", enforce_eager=False, max_num_seqs=32)
    started = time.perf_counter()
    manager = llm.engine.structured
    _ = manager.backend  # the library's import and the vocabulary's scan, once
    setup_ms = (time.perf_counter() - started) * 1e3
    compile_ms = compile_times(llm)
    print(f"grammar backend set-up {setup_ms:.0f} ms; compile per schema: median "
          f"{statistics.median(compile_ms.values()):.1f} ms, max {max(compile_ms.values()):.1f} ms")
    results = {"model": llm.config.model, "suite_size": len(SUITE), "backend_setup_ms": setup_ms,
               "compile_ms": compile_ms}
    for sampled in (False, True):
        kind = "sampled" if sampled else "greedy"
        results[kind] = validity(llm, args.max_tokens, sampled)
        r = results[kind]
        bad = [name for name, s in r["schemas"].items() if not s["valid"]]
        print(f"{kind}: {r['valid']}/{r['total']} valid" + (f" (invalid: {bad})" if bad else ""))
    results["overhead"] = overhead(llm, args.rounds, max_tokens=48)
    o = results["overhead"]
    print(f"batch {o['batch']} decode step: constrained {o['median_step_ms']['constrained']:.2f} ms, "
          f"unconstrained {o['median_step_ms']['unconstrained']:.2f} ms, ratio {o['ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
