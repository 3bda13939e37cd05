"""What of a JSON schema xgrammar enforces, and the schemas fastgen therefore refuses or adjusts.

Refused (a ValueError naming the keyword's path): keywords xgrammar would silently not enforce
(`UNENFORCED`, each shown let through by xgrammar in tests/structured), an `allOf` of several
schemas, and `minLength`/`maxLength` beside a `pattern` or `format` (xgrammar enforces the
pattern or format and drops the lengths) or on a schema without a `type` (xgrammar lets any
value through). An output that passes the grammar must be valid
against the schema.

Adjusted: xgrammar's rule for a length-limited string admits raw control characters, which a
JSON string cannot hold, so an output could pass the grammar and not be JSON. Such schemas are
compiled from xgrammar's own grammar text with that rule's character class narrowed to what a
JSON string may hold (`json_grammar`); where a later xgrammar writes the rule otherwise, the
lengths go to it as a pattern instead (`lengths_as_patterns`: right as well, but xgrammar expands
a pattern's repetition into states, which for limits in the thousands takes many seconds).

Subschemas are found under the keywords that hold them and behind local `$ref`s
(`subschemas`), wherever the reference points.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

UNENFORCED = ("if", "then", "else", "not", "dependentRequired", "dependentSchemas", "dependencies",
              "unevaluatedProperties", "unevaluatedItems", "uniqueItems", "contains", "minContains", "maxContains")
# Keywords whose value is a map of name -> subschema, a subschema (or a list of them), or a list.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_LENGTHS = ("minLength", "maxLength")
# A length-limited string's character in xgrammar's grammar text (any character but a quote, a
# backslash, CR and LF), and what a JSON string's unescaped character may be.
_XGRAMMAR_LENGTH_CHARACTER = '[^\\"\\\\\\r\\n]'
_JSON_CHARACTER = '[^\\0-\\x1f\\"\\\\]'


def subschemas(schema: object, path: str = "structured_outputs.json") -> Iterator[tuple[dict, str]]:
    """Every schema object in `schema`, itself first, with its path; a local `$ref`'s target once,
    under the path of the first reference to it."""
    seen: set[int] = set()

    def walk(node: object, where: str) -> Iterator[tuple[dict, str]]:
        if isinstance(node, list):
            for i, item in enumerate(node):
                yield from walk(item, f"{where}[{i}]")
            return
        if not isinstance(node, dict) or id(node) in seen:
            return
        seen.add(id(node))
        yield node, where
        for keyword in _SCHEMA_MAPS:
            if isinstance(node.get(keyword), dict):
                for name, sub in node[keyword].items():
                    yield from walk(sub, f"{where}.{keyword}.{name}")
        for keyword in (*_SCHEMA_VALUES, *_SCHEMA_LISTS):
            yield from walk(node.get(keyword), f"{where}.{keyword}")
        target = _resolve(schema, node.get("$ref"))
        if target is not None:
            yield from walk(target, f"{where}.$ref")

    return walk(schema, path)


def _resolve(root: object, ref: object) -> object | None:
    """The target of a local reference ("#", "#/a/b", with JSON pointer escapes), or None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def unenforced_keyword(schema: object, path: str = "structured_outputs.json") -> str | None:
    """The path of the first keyword in `schema` that the grammar would not enforce, or None."""
    for node, where in subschemas(schema, path):
        for keyword in UNENFORCED:
            if keyword in node:
                return f"{where}.{keyword}"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return f"{where}.allOf (with more than one schema)"
    return None


def check_lengths(schema: object) -> int:
    """How many string schemas in `schema` limit their length (each a length rule in xgrammar's
    grammar); ValueError naming the path of a limit that is not an integer >= 0, a minLength above
    its maxLength, a limit beside a pattern or format, or one on a schema that does not say it is
    a string (xgrammar lets any value through there, strings of any length included)."""
    limited = 0
    for node, where in subschemas(schema):
        limits = [keyword for keyword in _LENGTHS if keyword in node]
        if not limits or "enum" in node or "const" in node:  # (the listed values are the output)
            continue
        if _no_limit(node):
            continue
        for other in ("pattern", "format"):
            if other in node:
                raise ValueError(f"{where}.{limits[0]} together with {other} is not supported: xgrammar enforces "
                                 f"the {other} alone, so outputs could break the length limit")
        for keyword in limits:
            value = node[keyword]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}.{keyword}={value!r} must be an integer >= 0")
        if len(limits) == 2 and node["minLength"] > node["maxLength"]:
            raise ValueError(f"{where}.minLength={node['minLength']} must be <= maxLength={node['maxLength']}")
        types = node.get("type")
        if "type" not in node:
            raise ValueError(f"{where}.{limits[0]} needs \"type\": \"string\" beside it: xgrammar limits the length "
                             "of string schemas only")
        limited += types == "string" or (isinstance(types, list) and "string" in types)
    return limited


def json_grammar(schema_text: str, xgr, num_limited: int, **options) -> str | None:
    """xgrammar's grammar text for a schema with `num_limited` length-limited string schemas,
    with the limited strings' characters narrowed to a JSON string's; None where xgrammar no
    longer writes a length rule for each as this expects (`lengths_as_patterns` then)."""
    text = str(xgr.Grammar.from_json_schema(schema_text, **options))
    if text.count(_XGRAMMAR_LENGTH_CHARACTER) < num_limited:
        return None
    return text.replace(_XGRAMMAR_LENGTH_CHARACTER, _JSON_CHARACTER)


def lengths_as_patterns(schema: object) -> object:
    """A copy of `schema` with each string length limit written as a pattern of that many JSON
    string characters other than backslashes (xgrammar's length rule admitted no escapes either)."""
    schema = copy.deepcopy(schema)
    for node, _ in subschemas(schema):
        if _no_limit(node):
            node.pop("minLength")  # (beside a pattern that stays)
        elif any(keyword in node for keyword in _LENGTHS):
            low, high = node.pop("minLength", 0), node.pop("maxLength", "")
            node["pattern"] = '^[^\\x00-\\x1f"\\\\]{%d,%s}$' % (low, high)
    return schema


def _no_limit(node: dict) -> bool:
    """A minLength of 0 alone (pydantic's min_length=0): it limits nothing."""
    return "maxLength" not in node and type(node.get("minLength")) is int and node["minLength"] == 0
