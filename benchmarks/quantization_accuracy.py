"""How much quantization costs in accuracy, on the default model (or any `--model`):

- perplexity of a fixed English text (its first `--tokens` tokens, through `prompt_logprobs`),
  per format;
- greedy agreement with the unquantized engine: the unquantized engine's greedy continuation of
  each of a set of chat prompts is fed to the quantized engine as a prompt, and the share of its
  positions where the quantized model's most likely token is that same token (`prompt_logprobs`
  rank 1). Each position is judged in the same context, so one early difference does not count
  against every position after it.

Both go through prompt passes, whose products take many rows at once (the CPU's GEMM, rows as
they are). `--rows-per-step 2` cuts the passes into steps of 2 tokens, so that every product
takes the few rows a decode step's does (on a CPU: the GEMV, which rounds bf16 rows to int8 in
blocks of 32 where the processor has VNNI; `--plain-rows` switches that rounding off).

Usage: python benchmarks/quantization_accuracy.py [--text FILE] [--tokens N] [--formats ...]
       [--rows-per-step R] [--plain-rows] [--json PATH]
The default text is the GNU GPL version 3 as Debian ships it (/usr/share/common-licenses/GPL-3):
plain English prose, fixed, and present on every Debian machine.
"""

from __future__ import annotations

import argparse
import json
import math
import time

from fastgen import LLM, SamplingParams
from fastgen.engine.prompts import chat_token_ids

PROMPTS = [
    "The capital of France is", "Write a short poem about the sea.", "Explain what a hash table is.",
    "def quicksort(items):", "List three uses of copper.", "Once upon a time, in a small village,",
    "What is the difference between weather and climate?", "Translate 'good morning' into Spanish.",
    "The three laws of thermodynamics are", "Give me a recipe for pancakes.",
    "Why is the sky blue?", "Summarize the plot of Romeo and Juliet.",
]


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    out = llm.generate([token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
    logprobs = [entry[token].logprob for token, entry in zip(token_ids[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy(llm: LLM, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """Per prompt: (the chat prompt's tokens, the greedy continuation)."""
    prompts = [chat_token_ids(llm.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [(prompt, out.outputs[0].token_ids) for prompt, out in zip(prompts, llm.generate(prompts, params))]


def agreement(llm: LLM, continuations: list[tuple[list[int], list[int]]]) -> float:
    """Share of the continuations' tokens that are `llm`'s most likely token in their context."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outs = llm.generate([prompt + tokens for prompt, tokens in continuations], params)
    top = [entry[token].rank == 1 for (prompt, tokens), out in zip(continuations, outs)
           for token, entry in zip(tokens, out.prompt_logprobs[len(prompt):])]
    return sum(top) / len(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--formats", nargs="+", default=["none", "int8", "int4", "gguf"])
    parser.add_argument("--rows-per-step", type=int, default=None,
                        help="prompt tokens a step (default: the engine's budget): 2 for the decode steps' products")
    parser.add_argument("--plain-rows", action="store_true", help="CPU GEMV: bf16 rows as they are, not rounded")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.plain_rows:
        from fastgen.cpu.native.quantized_linear import set_rounded_inputs

        set_rounded_inputs(False)
    chunks = {} if args.rows_per_step is None else dict(max_num_seqs=1, max_num_batched_tokens=args.rows_per_step)
    results, baseline = {}, None
    for fmt in args.formats:
        start = time.perf_counter()
        llm = LLM(args.model, quantization=None if fmt == "none" else fmt, max_model_len=args.tokens + 8,
                  enforce_eager=True, **chunks)
        ids = llm.tokenizer.encode(open(args.text).read())[: args.tokens]
        row = {"perplexity": perplexity(llm, ids), "tokens": len(ids)}
        if baseline is None:
            baseline = greedy(llm, args.max_tokens)
        row["greedy_agreement"] = agreement(llm, baseline)
        row["seconds"] = time.perf_counter() - start
        results[fmt] = row
        print(fmt, json.dumps(row), flush=True)
        del llm
    base = results[args.formats[0]]["perplexity"]
    for fmt, row in results.items():
        print(f"{fmt:6s} perplexity {row['perplexity']:.3f} ({row['perplexity'] / base - 1:+.2%}), "
              f"greedy agreement {row['greedy_agreement']:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
