"""transformers' greedy continuation under the same grammar, through xgrammar's own logits
processor for transformers: the reference a constrained fastgen output must equal."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastgen.structured.regex import full_match_regex
from fastgen.structured.xgrammar_backend import compile_json_schema
from fastgen.structured_outputs_params import StructuredOutputsParams


def compile_reference(compiler, spec: StructuredOutputsParams):
    """The spec compiled by xgrammar directly, with the settings fastgen documents (a schema as
    `compile_json_schema` compiles it: strict, whitespace capped, string lengths held to JSON's
    characters; a regex as `full_match_regex` rewrites it)."""
    import xgrammar as xgr

    if spec.kind in ("json", "json_object"):
        return compile_json_schema(compiler, xgr, spec.json if spec.kind == "json" else {"type": "object"})
    if spec.kind == "regex":
        return compiler.compile_regex(full_match_regex(spec.regex))
    if spec.kind == "choice":
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
    return compiler.compile_grammar(spec.grammar)


def hf_constrained_greedy(model_dir: str, prompts: list[list[int]], specs: list[StructuredOutputsParams | None],
                          max_new_tokens: int, eos_token_id: int = 0) -> list[list[int]]:
    """Each prompt's greedy tokens, under its spec (None: unconstrained), stopping at EOS."""
    import xgrammar as xgr

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size,
                                             stop_token_ids=[eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    results = []
    with torch.no_grad():
        for ids, spec in zip(prompts, specs):
            processors = [] if spec is None else [xgr.contrib.hf.LogitsProcessor(compile_reference(compiler, spec))]
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
                                 logits_processor=processors, eos_token_id=eos_token_id, pad_token_id=eos_token_id,
                                 min_new_tokens=0)
            results.append(out[0, len(ids):].tolist())
    return results


def matches_grammar(compiler, spec: StructuredOutputsParams, token_ids: list[int], complete: bool) -> bool:
    """Whether the tokens are a sentence of the spec's grammar (a prefix of one when not complete)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compile_reference(compiler, spec))
    if not all(matcher.accept_token(t) for t in token_ids):
        return False
    return matcher.is_terminated() or matcher.is_completed() if complete else True
