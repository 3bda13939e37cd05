"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a few
strings, or an EBNF grammar (vLLM's `StructuredOutputsParams`, under vLLM's names).

Only the shape of each field is checked here; whether a schema, regex or grammar can be compiled
is the grammar backend's check, made when the request is added (`fastgen.structured`), so both
kinds of mistake are a ValueError before anything is queued.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from fastgen.checks import keep_signature, known_fields

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@keep_signature
@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of:

    json: a JSON schema (a dict, or its JSON text); the output is one JSON value valid against it.
    json_object: True; the output is any JSON object.
    regex: the output matches this regular expression in full.
    choice: the output is exactly one of these strings.
    grammar: the output is a sentence of this EBNF grammar (xgrammar's / GBNF's syntax; the rule
        `root` starts it).

    The grammar decides where the output ends: once it is complete only end-of-sequence may
    follow (so min_tokens does not hold the end back, and ignore_eos does not outlast it). An
    output that reaches max_tokens first ends with finish_reason "length", unfinished.
    """

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None

    def __new__(cls, *args, **kwargs):
        known_fields(cls, kwargs, "StructuredOutputsParams")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {list(KINDS)}, got {given or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            object.__setattr__(self, "json", _schema(value))
        elif kind == "json_object" and value is not True:
            raise ValueError(f"structured_outputs.json_object={value!r} must be True (or left unset)")
        elif kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"structured_outputs.{kind}={value!r} must be a non-empty string")
        elif kind == "choice":
            if isinstance(value, (str, bytes, dict)) or not isinstance(value, (list, tuple)) or not value:
                raise ValueError(f"structured_outputs.choice={value!r} must be a non-empty list of strings")
            for i, text in enumerate(value):
                if not isinstance(text, str) or not text:
                    raise ValueError(f"structured_outputs.choice[{i}]={text!r} must be a non-empty string")
            object.__setattr__(self, "choice", tuple(value))

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar: the kind and its text. A schema's key order is part
        of it: the grammar writes an object's properties in the order the schema lists them."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            return kind, json.dumps(value, ensure_ascii=False)
        if kind == "choice":
            return kind, json.dumps(list(value), ensure_ascii=False)
        return kind, str(value)

    @classmethod
    def from_dict(cls, fields: dict[str, Any], name: str = "structured_outputs") -> "StructuredOutputsParams":
        """From a request body's dict (vLLM's `structured_outputs` field); ValueError naming an
        unknown key."""
        if isinstance(fields, cls):
            return fields
        if not isinstance(fields, dict):
            raise ValueError(f"{name}={fields!r} must be an object with one of {list(KINDS)}")
        unknown = sorted(set(fields) - set(KINDS))
        if unknown:
            raise ValueError(f"{name} has unknown field(s) {unknown}; known: {list(KINDS)}")
        return cls(**{k: v for k, v in fields.items() if v is not None})


def _schema(value: object) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    if isinstance(value, bool) or not isinstance(value, dict):
        raise ValueError(f"structured_outputs.json={value!r} must be a JSON schema object (a dict or its JSON text)")
    return copy.deepcopy(value)  # the request's own: a caller's later edits change nothing
