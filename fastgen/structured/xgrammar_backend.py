"""The grammar backend over xgrammar (imported on the first structured request: ~2 s).

JSON schemas compile in xgrammar's strict mode (OpenAI's `strict`: an object schema that lists
its properties admits no others unless it says so), with any whitespace between tokens but at
most 16 whitespace characters in a row, so a small model cannot fill its budget with blank lines.
Keywords xgrammar would silently not enforce are refused (`UNENFORCED`, each shown let through by
xgrammar in tests/structured): an output that passes the grammar must be valid against the
schema. `oneOf` is enforced as `anyOf` (the branches of the
schemas that use it, pydantic's tagged unions among them, rarely overlap).

String lengths go to xgrammar as a `pattern` (`enforceable_schema`): its own rule for
`minLength`/`maxLength` admits raw control characters, which JSON strings cannot hold, so a
length-limited string could end an output `json.loads` refuses. With a `pattern` or `format` it
ignores the lengths, so those pairs are refused.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from fastgen.structured_outputs_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

MAX_WHITESPACE = 16
UNENFORCED = ("if", "then", "else", "not", "dependentRequired", "dependentSchemas", "dependencies",
              "unevaluatedProperties", "unevaluatedItems", "uniqueItems", "contains", "minContains", "maxContains")
# Keywords whose value is a map of name -> subschema, a subschema, or a list of subschemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
# xgrammar's messages start with "[time] /path/file.cc:line: " and sometimes a failed check's text.
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def unenforced_keyword(schema: object, path: str = "structured_outputs.json") -> str | None:
    """The path of the first keyword in `schema` that the grammar would not enforce, or None."""
    if not isinstance(schema, dict):
        return None
    for keyword in UNENFORCED:
        if keyword in schema:
            return f"{path}.{keyword}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"{path}.allOf (with more than one schema)"
    found = None
    for keyword in _SCHEMA_MAPS:
        for name, sub in (schema.get(keyword) or {}).items() if isinstance(schema.get(keyword), dict) else ():
            found = found or unenforced_keyword(sub, f"{path}.{keyword}.{name}")
    for keyword in _SCHEMA_VALUES:
        found = found or unenforced_keyword(schema.get(keyword), f"{path}.{keyword}")
    for keyword in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(keyword) or ()) if isinstance(schema.get(keyword), list) else ():
            found = found or unenforced_keyword(sub, f"{path}.{keyword}[{i}]")
    return found


def enforceable_schema(schema: object, path: str = "structured_outputs.json") -> object:
    """`schema` with every string length limit written as a pattern xgrammar enforces whole: a
    JSON string's characters other than control characters, quotes and backslashes, between
    `minLength` and `maxLength` of them (escapes were not admitted by its length rule either).
    ValueError, naming the path, where a limit sits with a `pattern` or `format`, which xgrammar
    would enforce without the limit."""
    if isinstance(schema, list):
        return [enforceable_schema(sub, f"{path}[{i}]") for i, sub in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for keyword, value in schema.items():
        if keyword in _SCHEMA_MAPS and isinstance(value, dict):
            out[keyword] = {name: enforceable_schema(sub, f"{path}.{keyword}.{name}") for name, sub in value.items()}
        elif keyword in _SCHEMA_VALUES or keyword in _SCHEMA_LISTS:
            out[keyword] = enforceable_schema(value, f"{path}.{keyword}")
        else:
            out[keyword] = value
    limits = [keyword for keyword in ("minLength", "maxLength") if keyword in out]
    if not limits:
        return out
    for other in ("pattern", "format"):
        if other in out:
            raise ValueError(f"{path}.{limits[0]} together with {other} is not supported: xgrammar enforces the "
                             f"{other} alone, so outputs could break the length limit")
    low, high = out.pop("minLength", 0), out.pop("maxLength", "")
    for name, limit in (("minLength", low), ("maxLength", high)):
        if limit != "" and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"{path}.{name}={limit!r} must be an integer >= 0")
    if high != "" and low > high:
        raise ValueError(f"{path}.minLength={low} must be <= maxLength={high}")
    out["pattern"] = '^[^\\x00-\\x1f"\\\\]{%d,%s}$' % (low, high)
    return out


def _hf_tokenizer(tokenizer):
    """xgrammar reads transformers' fast tokenizers; fastgen's own tokenizer wraps the same
    `tokenizers.Tokenizer`, so it is wrapped once more, not reloaded."""
    from transformers import PreTrainedTokenizerFast

    if isinstance(tokenizer, PreTrainedTokenizerFast):
        return tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)


class _Matcher:
    __slots__ = ("_matcher",)

    def __init__(self, matcher):
        self._matcher = matcher

    def accept(self, token: int) -> bool:
        return self._matcher.accept_token(token)

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class _Grammar:
    __slots__ = ("_compiled", "_xgr")

    def __init__(self, compiled, xgr):
        self._compiled = compiled
        self._xgr = xgr

    def matcher(self) -> _Matcher:
        return _Matcher(self._xgr.GrammarMatcher(self._compiled))


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2):
        try:
            import xgrammar
        except ImportError as exc:  # a setup dependency; a GPU machine's bare python may lack it
            raise ValueError(f"structured_outputs needs the xgrammar package, which is not installed ({exc}); "
                             "pip install xgrammar") from None
        self._xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(_hf_tokenizer(tokenizer), vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        # xgrammar's own cache is off: the manager keeps compiled grammars (and counts them).
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def compile(self, spec: StructuredOutputsParams) -> _Grammar:
        kind = spec.kind
        if kind == "json":
            where = unenforced_keyword(spec.json)
            if where is not None:
                raise ValueError(f"{where} is not supported: xgrammar cannot enforce it, so outputs could break "
                                 f"the schema (unsupported: {', '.join(UNENFORCED)}, allOf of several schemas)")
            enforceable_schema(spec.json)  # its refusals, before compiling
        try:
            compiled = self._compile(spec)
        except RuntimeError as exc:
            message = _NOISE.sub("", str(exc).strip()).strip()
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {message}") from None
        return _Grammar(compiled, self._xgr)

    def _compile(self, spec: StructuredOutputsParams):
        compiler, kind = self._compiler, spec.kind
        if kind in ("json", "json_object"):
            schema = enforceable_schema(spec.json) if kind == "json" else {"type": "object"}
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=True, strict_mode=True,
                                                max_whitespace_cnt=MAX_WHITESPACE)
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":  # JSON string escapes are the EBNF literals' escapes
            alternatives = " | ".join(json.dumps(text, ensure_ascii=False) for text in spec.choice)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        return compiler.compile_grammar(spec.grammar)

    def allocate_bitmask(self, rows: int) -> "torch.Tensor":
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)
