"""StructuredOutputsParams: exactly one kind, each of the right shape; dicts accepted where a
request body gives one; one key per distinct spec; keywords the grammar would not enforce found
wherever they sit in a schema; string lengths enforced as patterns that admit only what a JSON
string can hold."""

from __future__ import annotations

import pytest

from fastgen import SamplingParams
from fastgen.structured.xgrammar_backend import enforceable_schema, unenforced_keyword
from fastgen.structured_outputs_params import StructuredOutputsParams


@pytest.mark.parametrize("fields, message", [
    ({}, r"exactly one of .* got none"),
    ({"regex": "a", "choice": ["a"]}, r"exactly one of .* got \['regex', 'choice'\]"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": [1]}, "must be a JSON schema object"),
    ({"json_object": False}, "json_object=False must be True"),
    ({"regex": ""}, "regex='' must be a non-empty string"),
    ({"grammar": 5}, "grammar=5 must be a non-empty string"),
    ({"choice": "yes"}, "choice='yes' must be a non-empty list of strings"),
    ({"choice": []}, "must be a non-empty list"),
    ({"choice": ["a", ""]}, r"choice\[1\]='' must be a non-empty string"),
])
def test_bad_specs_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_a_dict_becomes_params_and_unknown_keys_are_named():
    params = SamplingParams(structured_outputs={"json": '{"type": "object"}'})
    assert params.structured_outputs == StructuredOutputsParams(json={"type": "object"})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['schema'\]"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match="must be an object"):
        SamplingParams(structured_outputs="json")


def test_one_key_per_distinct_spec():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"type": "object", "properties": {"x": {"type": "integer"}}}')
    assert a.key == b.key
    assert a.key != StructuredOutputsParams(json={"type": "object"}).key
    assert StructuredOutputsParams(choice=["a", "b"]).key != StructuredOutputsParams(choice=["b", "a"]).key


def test_unenforced_keywords_are_found_where_they_sit():
    assert unenforced_keyword({"type": "object", "properties": {"if": {"type": "string"}}}) is None  # a name
    assert unenforced_keyword({"$defs": {"A": {"dependentRequired": {}}}}) == "structured_outputs.json.$defs.A" \
        ".dependentRequired"
    assert unenforced_keyword({"items": {"anyOf": [{"type": "string"}, {"then": {}}]}}) == \
        "structured_outputs.json.items.anyOf[1].then"
    assert unenforced_keyword({"allOf": [{"type": "integer"}, {"minimum": 3}]}).endswith("allOf (with more than one "
                                                                                         "schema)")
    assert unenforced_keyword({"allOf": [{"type": "integer"}]}) is None


@pytest.mark.parametrize("schema, accepted", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]"),
    ({"type": "integer", "not": {"const": 3}}, "3"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependencies": {"a": ["b"]}}, '{"a": 1}'),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, '"a"'),
])
def test_each_refused_keyword_is_one_xgrammar_does_not_enforce(schema, accepted):
    """Why each keyword is refused: xgrammar's own grammar lets through an output that breaks it."""
    import json

    xgr = pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(c): c - 32 for c in range(32, 127)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="?")))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(vocab), stop_token_ids=[0])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema)))
    assert matcher.accept_string(accepted) and matcher.is_completed()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(json.loads(accepted))  # draft 7 still has `dependencies`
    assert unenforced_keyword(schema) is not None


def _xgrammar_matcher(schema: dict):
    """A matcher of xgrammar's grammar for `schema` over a vocabulary of one token per ASCII
    character, control characters included."""
    import json

    xgr = pytest.importorskip("xgrammar")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(c): c for c in range(1, 127)}
    vocab["<eos>"] = 0
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<eos>")))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(vocab), stop_token_ids=[0])
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), strict_mode=True))


def _accepts(schema: dict, text: str) -> bool:
    matcher = _xgrammar_matcher(schema)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": 5},
    {"type": "object", "properties": {"city": {"type": "string", "minLength": 1}}, "required": ["city"]},
])
def test_length_limited_strings_admit_no_control_characters(schema):
    """Why string lengths become patterns: xgrammar's own length rule lets a raw control
    character into a JSON string, which json.loads then refuses."""
    import json

    raw = '"a\x02b"' if schema["type"] == "string" else '{"city": "a\x02b"}'  # a raw control character
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw)
    assert _accepts(schema, raw)
    rewritten = enforceable_schema(schema)
    assert not _accepts(rewritten, raw)
    assert _accepts(rewritten, raw.replace("\x02", "-"))


def test_string_lengths_hold_in_characters_and_bad_ones_are_named():
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "string", "minLength": 2, "maxLength": 3}
    rewritten = enforceable_schema(schema)
    for text, valid in [('""', False), ('"a"', False), ('"ab"', True), ('"abc"', True), ('"abcd"', False)]:
        assert _accepts(rewritten, text) == valid, text
        assert jsonschema.Draft7Validator(schema).is_valid(__import__("json").loads(text)) == valid
    with pytest.raises(ValueError, match=r"structured_outputs.json.minLength=4 must be <= maxLength=3"):
        enforceable_schema({"minLength": 4, "maxLength": 3})
    with pytest.raises(ValueError, match=r"structured_outputs.json.items.maxLength=-1 must be an integer >= 0"):
        enforceable_schema({"type": "array", "items": {"type": "string", "maxLength": -1}})


@pytest.mark.parametrize("other", [{"pattern": "^a+$"}, {"format": "email"}])
def test_a_length_limit_beside_a_pattern_or_format_is_refused(other):
    """Why: xgrammar enforces the pattern or format and drops the limit."""
    schema = {"type": "object", "properties": {"x": {"type": "string", "maxLength": 2, **other}}}
    assert _accepts(schema, '{"x": "aaa"}' if "pattern" in other else '{"x": "a@b.cd"}')
    with pytest.raises(ValueError, match=r"structured_outputs.json.properties.x.maxLength together with "):
        enforceable_schema(schema)


def test_without_xgrammar_a_structured_request_is_a_clear_value_error(monkeypatch):
    from fastgen.structured.xgrammar_backend import XGrammarBackend

    monkeypatch.setitem(__import__("sys").modules, "xgrammar", None)
    with pytest.raises(ValueError, match="structured_outputs needs the xgrammar package"):
        XGrammarBackend(tokenizer=None, vocab_size=10, stop_token_ids=[0])
