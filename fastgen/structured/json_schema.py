"""What of a JSON schema xgrammar enforces, and the schemas fastgen therefore refuses or adjusts.

Refused (a ValueError naming the keyword's path): keywords xgrammar would silently not enforce
(`UNENFORCED`, each shown let through by xgrammar in tests/structured), an `allOf` of several
schemas, and `minLength`/`maxLength` beside a `pattern` or `format` (xgrammar enforces the
pattern or format and drops the lengths) or on a schema without a `type` (xgrammar lets any
value through); keywords xgrammar compiles and then drops where they sit (`dropped_keyword`:
value keywords without a type, what stands beside anyOf / oneOf / enum / const, multipleOf but
an integer's, a reference to another document). An output that passes the grammar must be
valid against the schema.

Adjusted (`adjusted`): a required property the schema does not list, and item or property counts
on arrays and objects that name none, are made explicit, as strict mode would otherwise read
them (an empty object for `{"required": ["a"]}`, a refusal for `{"minItems": 2}`).

Also adjusted: xgrammar's rule for a length-limited string admits raw control characters, which a
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
import re
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


# Keywords that constrain a value (JSON Schema's assertions and applicators); any other keyword
# (a title, a description, OpenAPI's `example`, an `x-` extension) constrains nothing.
_CONSTRAINTS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "items", "prefixItems", "additionalItems", "contains",
    "maxItems", "minItems", "uniqueItems", "maxContains", "minContains", "properties", "patternProperties",
    "additionalProperties", "propertyNames", "required", "maxProperties", "minProperties", "dependentRequired",
    "dependentSchemas", "dependencies", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref",
    "unevaluatedItems", "unevaluatedProperties"})
# Keywords that xgrammar enforces alone: it drops the constraints beside them.
_ALONE = {"anyOf": "xgrammar enforces anyOf's branches alone",
          "oneOf": "xgrammar enforces oneOf's branches alone",
          "allOf": "xgrammar enforces allOf's schema alone",
          "$ref": "xgrammar enforces the referenced schema alone"}
# Keywords xgrammar enforces only where the schema says its type: without one it lets any value
# through (a `{"minimum": 5}` admits 1).
_NEED_A_TYPE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "pattern", "format",
                "minItems", "maxItems", "required", "minProperties", "maxProperties")
_SAY_A_TYPE = frozenset({"enum", "const", "$ref", "anyOf", "oneOf", "allOf", "properties", "patternProperties",
                         "additionalProperties", "items", "prefixItems"})
_JSON_TYPES = {"string": str, "null": type(None), "array": list, "object": dict}


def dropped_keyword(schema: object, path: str = "structured_outputs.json") -> tuple[str, str] | None:
    """(path, why) of the first keyword in `schema` that xgrammar would compile and then drop, or
    None: a value keyword on a schema without a `type`; any constraint beside `anyOf`, `oneOf`,
    `allOf` or `$ref` (xgrammar keeps those alone), or beside `enum` / `const` (the listed values
    alone; a `type` there must hold for each of them); `multipleOf` other than an integer on an
    integer schema; a `$ref` to another document. Descriptions may stand anywhere."""
    for node, where in subschemas(schema, path):
        for alone, why in _ALONE.items():
            if alone in node:
                beside = sorted(set(node) & _CONSTRAINTS - {alone})
                if beside:
                    return f"{where}.{beside[0]}", f"{why} and drops what is beside it"
        for listed in ("enum", "const"):
            if listed in node:
                beside = sorted(set(node) & _CONSTRAINTS - {listed, "type"})
                if beside:
                    return f"{where}.{beside[0]}", f"xgrammar outputs one of the {listed} values and drops what is beside it"
                values = node[listed] if listed == "enum" and isinstance(node[listed], list) else [node[listed]]
                for value in values:
                    if "type" in node and not _has_type(value, node["type"]):
                        return f"{where}.{listed}", f"the value {value!r} is not of type {node['type']!r}"
        # (`properties` or `items` make xgrammar read an object or an array, and it enforces those)
        if "type" not in node and not _SAY_A_TYPE & set(node):
            for keyword in _NEED_A_TYPE:
                if keyword in node:
                    return f"{where}.{keyword}", "xgrammar enforces it only beside a \"type\""
        if "multipleOf" in node:
            value, types = node["multipleOf"], node.get("type")
            integer = (set(types) if isinstance(types, list) else {types}) - {"null"} == {"integer"}
            if not integer or isinstance(value, bool) or not isinstance(value, int) or value < 1:
                return f"{where}.multipleOf", "xgrammar enforces it only as an integer >= 1 on an integer schema"
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return f"{where}.$ref", "only references within the schema (\"#...\") can be resolved"
    return None


def _has_type(value: object, types: object) -> bool:
    names = types if isinstance(types, list) else [types]
    if isinstance(value, bool):
        return "boolean" in names
    if isinstance(value, (int, float)):
        return "number" in names or "integer" in names and float(value).is_integer()
    return any(name in _JSON_TYPES and isinstance(value, _JSON_TYPES[name]) for name in names)


def adjusted(schema: object) -> object:
    """A copy of `schema` that xgrammar's strict mode compiles as the schema means it:
    - a `required` name its `properties` do not list gets a property of its own (the schema of
      the first `patternProperties` pattern it matches, else the `additionalProperties` schema,
      else any value; an object that named no properties stays open to others): xgrammar
      requires listed properties only, and in strict mode admits no other, so `{"required":
      ["a"]}` gave `{}` alone (refused where the schema forbids such a property: nothing could
      satisfy it);
    - an array limited by `minItems` / `maxItems` with no `items`, or an object limited by
      `minProperties` / `maxProperties` with no properties named, admits any items or
      properties, as it does without the limit (strict mode refused those schemas)."""
    schema = copy.deepcopy(schema)
    for node, where in subschemas(schema):
        required, properties = node.get("required"), node.get("properties", {})
        if isinstance(required, list) and isinstance(properties, dict):
            # An object that named no properties admits any (xgrammar's strict mode reads a bare
            # object so): naming the required ones must not close it.
            was_open = not {"properties", "patternProperties", "additionalProperties"} & set(node)
            extra = node.get("additionalProperties", True)
            for name in required:
                if not isinstance(name, str) or name in properties:
                    continue
                matching = [sub for pattern, sub in node.get("patternProperties", {}).items()
                            if isinstance(pattern, str) and _searches(pattern, name)]
                if matching:
                    value = matching[0]
                elif extra is False:
                    raise ValueError(f"{where}.required names {name!r}, which neither its properties nor its "
                                     "patternProperties admit, and additionalProperties is false: no output could "
                                     "hold it")
                else:
                    value = extra
                properties[name] = copy.deepcopy(value) if isinstance(value, dict) else {}
                node["properties"] = properties
                if was_open:
                    node["additionalProperties"] = True
        if node.get("type") == "array" and {"minItems", "maxItems"} & set(node) \
                and not {"items", "prefixItems"} & set(node):
            node["items"] = {}
        if node.get("type") == "object" and {"minProperties", "maxProperties"} & set(node) \
                and not {"properties", "patternProperties", "additionalProperties"} & set(node):
            node["additionalProperties"] = True
    return schema


def _searches(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False


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
