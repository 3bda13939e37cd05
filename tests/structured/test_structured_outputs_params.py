"""StructuredOutputsParams: exactly one kind, each of the right shape; dicts accepted where a
request body gives one; one key per distinct spec; keywords the grammar would not enforce found
wherever they sit in a schema; string lengths enforced as patterns that admit only what a JSON
string can hold."""

from __future__ import annotations

import json
import re

import pytest

from fastgen import SamplingParams
from fastgen.structured.json_schema import check_lengths, json_grammar, lengths_as_patterns, unenforced_keyword
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
    assert unenforced_keyword({"properties": {"a": {"$ref": "#/components/A"}}, "components": {"A": {"not": {}}}}) \
        == "structured_outputs.json.properties.a.$ref.not"
    assert unenforced_keyword({"$defs": {"A": {"$ref": "#/$defs/A"}}}) is None  # a cycle ends


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


@pytest.mark.parametrize("schema, accepted, where", [
    ({"type": "number", "multipleOf": 0.5}, "0.3", "multipleOf"),
    ({"type": "number", "multipleOf": 2}, "3", "multipleOf"),
    ({"minimum": 5}, "1", "minimum"),
    ({"pattern": "^a$"}, '"b"', "pattern"),
    ({"maxItems": 1}, "[1, 2]", "maxItems"),
    ({"type": "string", "anyOf": [{"type": "integer"}]}, "1", "type"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"type": "object"}]}, '{"a": "s"}',
     "properties"),
    ({"type": "integer", "enum": [1, 2], "minimum": 2}, "1", "minimum"),
    ({"type": "integer", "enum": ["a"]}, '"a"', "enum"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, '{"a": [true]}',
     "properties.a.$ref"),
    ({"$defs": {"I": {"type": "integer"}}, "$ref": "#/$defs/I", "maximum": 3}, "5", "maximum"),
    ({"allOf": [{"type": "integer"}], "maximum": 3}, "5", "maximum"),
])
def test_keywords_xgrammar_compiles_and_drops_are_refused(schema, accepted, where):
    """xgrammar alone admits an output the schema rejects; fastgen refuses the schema, naming
    the keyword's path, before anything is queued."""
    jsonschema = pytest.importorskip("jsonschema")
    assert _accepts(schema, accepted, "xgrammar")
    with pytest.raises((jsonschema.ValidationError, jsonschema.exceptions._WrappedReferencingError)):
        jsonschema.validate(json.loads(accepted), schema)
    with pytest.raises(ValueError, match=re.escape(f"structured_outputs.json.{where} is not supported there")):
        _matcher(schema)


def test_descriptions_beside_a_union_or_an_enum_are_fine():
    """pydantic's Optional fields and enums: annotations beside anyOf / enum constrain nothing."""
    optional = {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "Year"}
    assert _accepts(optional, "null") and _accepts(optional, "1999")
    assert _accepts({"enum": ["red", "blue"], "title": "Color", "type": "string", "example": "red", "x-id": 1},
                    '"red"')
    referenced = {"$ref": "#/$defs/A", "description": "a year", "$defs": {"A": {"type": "integer"}}}
    assert _accepts(referenced, "3") and not _accepts(referenced, '"3"')
    assert _accepts({"type": ["integer", "null"], "multipleOf": 5}, "10") and \
        not _accepts({"type": ["integer", "null"], "multipleOf": 5}, "3")


@pytest.mark.parametrize("schema, valid, invalid", [
    # a required name the properties do not list: xgrammar's strict mode gave "{}" alone
    ({"type": "object", "required": ["answer"]}, '{"answer": [1, "x"]}', "{}"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"],
      "additionalProperties": {"type": "string"}}, '{"a": 1, "b": "x"}', '{"a": 1}'),
    # counts on an array or object that names no items or properties: strict mode refused them
    ({"type": "array", "minItems": 2}, '[1, "a"]', "[1]"),
    ({"type": "object", "minProperties": 1}, '{"k": null}', "{}"),
    # naming a required property keeps an object that named none open to others
    ({"type": "object", "required": ["a"], "minProperties": 2}, '{"a": 1, "b": 2}', '{"a": 1}'),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}, "required": ["ab"]}, '{"ab": 1}',
     '{"ab": "x"}'),
])
def test_schemas_strict_mode_misreads_are_compiled_as_meant(schema, valid, invalid):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(valid), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(invalid), schema)
    assert _accepts(schema, valid) and not _accepts(schema, invalid)


@pytest.mark.parametrize("regex, text, full_match", [
    ("a.b", "a\nb", False), ("a.b", "a-b", True), ("[.]", ".", True), ("[.]", "x", False),
    ("^a$", "a", True), ("[^]a.]+", "]", False), ("[^]a.]+", "b\n", True), ("[]a]", "]", True),
    ("\\Aa\\Z", "a", True), ("\\W", "é", True), ("\\d", "٣", False), ("[^\\d]", "٣", True),
])
def test_a_regex_admits_what_re_fullmatch_admits(regex, text, full_match):
    """As re.fullmatch reads it under re.ASCII (xgrammar's \\d, \\w, \\s are ASCII's)."""
    xgr = pytest.importorskip("xgrammar")
    from fastgen.structured.regex import full_match_regex

    assert bool(re.fullmatch(regex, text, flags=re.ASCII)) == full_match
    matcher = xgr.GrammarMatcher(_compiler().compile_regex(full_match_regex(regex)))
    assert (matcher.accept_string(text) and matcher.is_completed()) == full_match


@pytest.mark.parametrize("regex", ["a^b", "a$b", "a|^b", "a\\Ab", "a\\Zb", "\\ba"])
def test_an_anchor_inside_a_regex_is_refused(regex):
    from fastgen.structured.regex import full_match_regex

    with pytest.raises(ValueError, match="structured_outputs.regex"):
        full_match_regex(regex)


def _compiler():
    xgr = pytest.importorskip("xgrammar")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(c): c for c in range(1, 127)} | {"é": 127, "٣": 128}  # and two letters past ASCII
    vocab["<eos>"] = 0
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<eos>")))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(vocab), stop_token_ids=[0])
    return xgr.GrammarCompiler(info)


def _matcher(schema: dict, compile_with: str = "fastgen"):
    """A matcher over a vocabulary of one token per ASCII character, control characters included,
    of `schema` compiled by fastgen (`compile_json_schema`), by xgrammar alone ("xgrammar"), or by
    xgrammar from the schema with lengths as patterns ("patterns": fastgen's fallback)."""
    xgr = pytest.importorskip("xgrammar")
    from fastgen.structured.xgrammar_backend import compile_json_schema

    compiler = _compiler()
    if compile_with == "fastgen":
        return xgr.GrammarMatcher(compile_json_schema(compiler, xgr, schema))
    if compile_with == "patterns":
        schema = lengths_as_patterns(schema)
    return xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), strict_mode=True))


def _accepts(schema: dict, text: str, compile_with: str = "fastgen") -> bool:
    matcher = _matcher(schema, compile_with)
    return matcher.accept_string(text) and matcher.is_completed()


LIMITED = {
    "string": ({"type": "string", "maxLength": 5}, '"a\x02b"'),
    "property": ({"type": "object", "properties": {"city": {"type": "string", "minLength": 1}},
                  "required": ["city"]}, '{"city": "a\x02b"}'),
    "nullable": ({"type": ["string", "null"], "maxLength": 5}, '"a\x02b"'),
    # a reference to a place no keyword names: xgrammar resolves it, and so must the checks
    "reference": ({"type": "object", "properties": {"a": {"$ref": "#/components/S"}}, "required": ["a"],
                   "components": {"S": {"type": "string", "maxLength": 8000}}}, '{"a": "a\x02b"}'),
}


@pytest.mark.parametrize("case", LIMITED)
def test_length_limited_strings_admit_no_control_characters(case):
    """xgrammar's own length rule lets a raw control character into a JSON string, which
    json.loads then refuses (this asserts xgrammar's flaw, so that a release without it is
    noticed); fastgen's grammar, and its fallback of patterns, refuse it."""
    schema, raw = LIMITED[case]
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw)
    assert _accepts(schema, raw, "xgrammar")
    # fastgen's own route, not the fallback: xgrammar's grammar text, its character class narrowed
    assert json_grammar(json.dumps(schema), pytest.importorskip("xgrammar"), check_lengths(schema)) is not None
    # (xgrammar expands a pattern's {0,8000} into states for minutes: the fallback is for short limits)
    for compile_with in ("fastgen",) if case == "reference" else ("fastgen", "patterns"):
        assert not _accepts(schema, raw, compile_with)
        assert _accepts(schema, raw.replace("\x02", "-"), compile_with)


@pytest.mark.parametrize("compile_with", ["fastgen", "patterns"])
def test_string_lengths_hold_in_characters(compile_with):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "string", "minLength": 2, "maxLength": 3}
    for text, valid in [('""', False), ('"a"', False), ('"ab"', True), ('"abc"', True), ('"abcd"', False)]:
        assert _accepts(schema, text, compile_with) == valid, text
        assert jsonschema.Draft7Validator(schema).is_valid(json.loads(text)) == valid


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "minLength": 4, "maxLength": 3},
     r"structured_outputs.json.minLength=4 must be <= maxLength=3"),
    ({"type": "array", "items": {"type": "string", "maxLength": -1}},
     r"structured_outputs.json.items.maxLength=-1 must be an integer >= 0"),
    ({"properties": {"a": {"$ref": "#/x"}}, "x": {"maxLength": 2, "pattern": "a+"}},
     r"structured_outputs.json.properties.a.\$ref.maxLength together with pattern"),
    ({"type": "array", "items": {"maxLength": 2}},
     r"structured_outputs.json.items.maxLength needs \"type\": \"string\" beside it"),
])
def test_bad_string_lengths_are_named(schema, message):
    with pytest.raises(ValueError, match=message):
        check_lengths(schema)


def test_a_length_limit_on_a_schema_not_typed_string_is_refused():
    """Why: xgrammar lets any value through there, a string of any length included."""
    schema = {"type": "object", "properties": {"a": {"maxLength": 2}}}
    assert _accepts(schema, '{"a": "abcdef"}', "xgrammar")
    with pytest.raises(ValueError, match=r"properties.a.maxLength needs \"type\": \"string\""):
        check_lengths(schema)
    assert check_lengths({"type": "integer", "maxLength": 2}) == 0  # (a limit on no string: nothing to do)
    assert check_lengths({"minLength": 0, "pattern": "a+"}) == 0  # (no limit at all)
    assert lengths_as_patterns({"type": "string", "minLength": 0, "pattern": "a+"}) == {"type": "string",
                                                                                        "pattern": "a+"}
    with pytest.raises(ValueError, match="minLength=False must be an integer"):
        check_lengths({"type": "string", "minLength": False})


@pytest.mark.parametrize("other", [{"pattern": "^a+$"}, {"format": "email"}])
def test_a_length_limit_beside_a_pattern_or_format_is_refused(other):
    """Why: xgrammar enforces the pattern or format and drops the limit."""
    schema = {"type": "object", "properties": {"x": {"type": "string", "maxLength": 2, **other}}}
    assert _accepts(schema, '{"x": "aaa"}' if "pattern" in other else '{"x": "a@b.cd"}', "xgrammar")
    with pytest.raises(ValueError, match=r"structured_outputs.json.properties.x.maxLength together with "):
        check_lengths(schema)


def test_without_xgrammar_a_structured_request_is_a_clear_value_error(monkeypatch):
    from fastgen.structured.xgrammar_backend import XGrammarBackend

    monkeypatch.setitem(__import__("sys").modules, "xgrammar", None)
    with pytest.raises(ValueError, match="structured_outputs needs the xgrammar package"):
        XGrammarBackend(tokenizer=None, vocab_size=10, stop_token_ids=[0])
