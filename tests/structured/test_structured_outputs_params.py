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
    b = StructuredOutputsParams(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}')
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


def test_without_xgrammar_a_structured_request_is_a_clear_value_error(monkeypatch):
    from fastgen.structured.xgrammar_backend import XGrammarBackend

    monkeypatch.setitem(__import__("sys").modules, "xgrammar", None)
    with pytest.raises(ValueError, match="structured_outputs needs the xgrammar package"):
        XGrammarBackend(tokenizer=None, vocab_size=10, stop_token_ids=[0])
