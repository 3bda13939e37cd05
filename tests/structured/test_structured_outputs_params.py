"""StructuredOutputsParams: exactly one kind, each of the right shape; dicts accepted where a
request body gives one; one key per distinct spec; keywords the grammar would not enforce found
wherever they sit in a schema."""

from __future__ import annotations

import pytest

from fastgen import SamplingParams
from fastgen.structured.xgrammar_backend import unenforced_keyword
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


def test_without_xgrammar_a_structured_request_is_a_clear_value_error(monkeypatch):
    from fastgen.structured.xgrammar_backend import XGrammarBackend

    monkeypatch.setitem(__import__("sys").modules, "xgrammar", None)
    with pytest.raises(ValueError, match="structured_outputs needs the xgrammar package"):
        XGrammarBackend(tokenizer=None, vocab_size=10, stop_token_ids=[0])
