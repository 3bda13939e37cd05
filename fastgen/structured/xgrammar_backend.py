"""The grammar backend over xgrammar (imported on the first structured request: ~2 s).

JSON schemas compile in xgrammar's strict mode (OpenAI's `strict`: an object schema that lists
its properties admits no others unless it says so), with any whitespace between tokens but at
most 16 whitespace characters in a row, so a small model cannot fill its budget with blank lines.
What of a schema xgrammar enforces, and what is refused or adjusted so that an output that passes
the grammar is valid JSON against the schema: `json_schema.py`. `oneOf` is enforced as `anyOf`
(the branches of the schemas that use it, pydantic's tagged unions among them, rarely overlap).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from fastgen.structured.json_schema import (
    UNENFORCED,
    adjusted,
    check_lengths,
    dropped_keyword,
    json_grammar,
    lengths_as_patterns,
    unenforced_keyword,
)
from fastgen.structured.regex import full_match_regex
from fastgen.structured_outputs_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

MAX_WHITESPACE = 16
# xgrammar's messages start with "[time] /path/file.cc:line: " and sometimes a failed check's text.
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def compile_json_schema(compiler, xgr, schema: object):
    """`schema` compiled with fastgen's settings (strict, whitespace capped), string lengths
    held to what a JSON string may hold (`json_schema.py`); the schema's refusals checked first."""
    options = dict(any_whitespace=True, strict_mode=True, max_whitespace_cnt=MAX_WHITESPACE)
    where = unenforced_keyword(schema)
    if where is not None:
        raise ValueError(f"{where} is not supported: xgrammar cannot enforce it, so outputs could break "
                         f"the schema (unsupported: {', '.join(UNENFORCED)}, allOf of several schemas)")
    dropped = dropped_keyword(schema)
    if dropped is not None:
        raise ValueError(f"{dropped[0]} is not supported there: {dropped[1]}, so outputs could break the schema")
    schema = adjusted(schema)
    num_limited = check_lengths(schema)
    if not num_limited:
        return compiler.compile_json_schema(json.dumps(schema), **options)
    grammar = json_grammar(json.dumps(schema), xgr, num_limited, **options)
    if grammar is not None:
        return compiler.compile_grammar(grammar)
    return compiler.compile_json_schema(json.dumps(lengths_as_patterns(schema)), **options)


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
        try:
            compiled = self._compile(spec)
        except RuntimeError as exc:
            message = _NOISE.sub("", str(exc).strip()).strip()
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {message}") from None
        # A grammar no output can follow (a regex such as [^\s\S]) would fail its request's
        # first step: refused here, where the caller learns why.
        first = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        self._xgr.GrammarMatcher(compiled).fill_next_token_bitmask(first, 0)
        if not first.any():
            raise ValueError(f"structured_outputs.{kind} admits no output at all: not even its first token "
                             "can be chosen")
        return _Grammar(compiled, self._xgr)

    def _compile(self, spec: StructuredOutputsParams):
        compiler, kind = self._compiler, spec.kind
        if kind in ("json", "json_object"):
            return compile_json_schema(compiler, self._xgr, spec.json if kind == "json" else {"type": "object"})
        if kind == "regex":
            return compiler.compile_regex(full_match_regex(spec.regex))
        if kind == "choice":  # JSON string escapes are the EBNF literals' escapes
            alternatives = " | ".join(json.dumps(text, ensure_ascii=False) for text in spec.choice)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        return compiler.compile_grammar(spec.grammar)

    def allocate_bitmask(self, rows: int) -> "torch.Tensor":
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)
