"""Speculative decoding (prompt lookup, or a draft model) on the default model (or any `--model`):
decode speed with and without it, by kind of prompt, at batch 1 and in a batch of 16.

- copy-heavy prompts: repeat a text, rename a variable in a function, correct a paragraph's
  typos: the answer repeats much of the prompt, so lookup drafts are often right;
- free prompts: a story, an explanation, a list of ideas: little to look up.

Batch 1: each prompt alone, greedy, max_tokens new tokens; decode tok/s of a request is
(output tokens - 1) / (last token time - first token time), so the prompt's prefill is not in
it; on each prompt the two engines back to back (their order alternating), --rounds times; a
prompt's speedup is the median of its rounds' ratios (a short answer's rate drifts with the
machine from round to round, less within one pair); medians per kind. Batches (--batch-sizes, 16 by
default): max_num_seqs of that size kept full (requests always waiting for a slot, the copy and
free prompts in turn, each making a fixed number of tokens from max_tokens / 2 to max_tokens
with ignore_eos, the same in both engines; a finite set of requests would end in a tail of a
few, which would measure the tail, not the batch), output tokens per second over a --seconds
window after a quarter of it for the start; the engines back to back in each round, their order
alternating, the speedup the median of the rounds' ratios. Both engines compile in blocking mode
before anything is timed. Reports acceptance (draft tokens kept / proposed, and
per draft position) and whether greedy outputs are identical with and without drafts (in bf16
a verify step's products of several rows may round differently from a decode step's, so a near
tie can go the other way; in float32 the tests require equality).

`--method draft_model` drafts with `--draft-model` (default: the model itself) quantized by
`--draft-quantization` (default int4): the model's own int4 twin, which agrees with it on most
tokens at about a third of its weight bytes.

Usage: python benchmarks/speculative_decoding.py [--model PATH] [--quantization Q]
       [--method ngram|draft_model] [--draft-model PATH] [--draft-quantization Q|none]
       [--num-speculative-tokens K] [--prompt-lookup-max N] [--prompt-lookup-min N]
       [--max-tokens N] [--rounds R] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from fastgen import LLM, SamplingParams
from fastgen.engine.prompts import chat_token_ids

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He polished the great lens, "
    "trimmed the wick, and wrote the weather in a leather notebook: wind from the west, a light rain, "
    "three fishing boats returning before dark. In forty years he had never missed a night, not even "
    "during the storm that took the old pier, when the waves reached the second window of the tower."
)
CODE = '''def average_length(words):
    total = 0
    n = 0
    for word in words:
        if word:
            total += len(word)
            n += 1
    if n == 0:
        return 0.0
    return total / n
'''
TYPOS = ("Our team met on tusday to discus the new schedle. Everyone agred that the deadline was to "
         "tight, so we decided to move the relase by one week and to ask for more testers. The next "
         "meeting will be on frday at ten oclock in the large confrence room.")
COPY = {
    "repeat": f"Repeat the following text exactly, word for word, and nothing else:\n\n{TEXT}",
    "rename": f"Rewrite this Python function with the variable `n` renamed to `count`. Output only the code.\n\n{CODE}",
    "typos": f"Correct the spelling mistakes in this paragraph and output the whole corrected paragraph:\n\n{TYPOS}",
}
FREE = {
    "story": "Write a short story about a dragon who learns to bake bread.",
    "explain": "Explain in a few paragraphs why the sky is blue.",
    "ideas": "Give me ten ideas for a weekend trip with children, with a sentence about each.",
}


def decode_rate(out) -> float:
    m = out.metrics
    return (m.num_output_tokens - 1) / (m.last_token_time - m.first_token_time)


def in_turn(engines: dict[str, LLM], round_index: int) -> list[tuple[str, LLM]]:
    """The engines in their order in even rounds, reversed in odd ones."""
    order = list(engines.items())
    return order if round_index % 2 == 0 else order[::-1]


def batch_one(engines: dict[str, LLM], prompts: dict[str, list[int]], params: SamplingParams, rounds: int) -> dict:
    rates: dict[str, dict[str, list[float]]] = {name: {p: [] for p in prompts} for name in engines}
    outputs: dict[str, dict[str, list[int]]] = {name: {} for name in engines}
    accept = {p: None for p in prompts}
    for round_index in range(rounds):
        for label, ids in prompts.items():
            # The two engines back to back on each prompt, their order alternating by round, so
            # that the machine's drift (a neighbour, the clock) weighs on both alike.
            for name, llm in in_turn(engines, round_index):
                (out,) = llm.generate([ids], params, use_tqdm=False)
                rates[name][label].append(decode_rate(out))
                outputs[name][label] = out.token_ids
                if name == "speculative":
                    m = out.metrics
                    accept[label] = {"draft_tokens": m.num_draft_tokens, "accepted": m.num_accepted_draft_tokens,
                                     "per_position": m.accepted_per_position, "output_tokens": m.num_output_tokens}
    rows = {}
    for label in prompts:
        plain, spec = (statistics.median(rates[name][label]) for name in ("plain", "speculative"))
        # The speedup is the median of each round's pair, not the ratio of the two medians.
        speedup = statistics.median(s / p for s, p in zip(rates["speculative"][label], rates["plain"][label]))
        rows[label] = {"plain_tok_s": plain, "speculative_tok_s": spec, "speedup": speedup,
                       "plain_tok_s_by_round": rates["plain"][label],
                       "speculative_tok_s_by_round": rates["speculative"][label],
                       "identical_output": outputs["plain"][label] == outputs["speculative"][label],
                       "acceptance": accept[label]}
        print(f"  {label:8s} {plain:7.1f} -> {spec:7.1f} tok/s ({speedup:.2f}x); drafts "
              f"{accept[label]['accepted']}/{accept[label]['draft_tokens']} kept; identical: "
              f"{rows[label]['identical_output']}", flush=True)
    return rows


def saturated_rate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], seconds: float) -> float:
    """Output tokens per second of an engine kept full: requests (the prompts in turn) are added
    so that some always wait for a slot, and the tokens of the steps that ended within
    `seconds` after the first `seconds / 4` (the start-up wave left behind) are counted."""
    engine = llm.engine
    slots = llm.config.max_num_seqs
    added = 0
    start = time.perf_counter()
    warm_until, end = start + seconds / 4, start + seconds / 4 + seconds
    tokens = 0
    while True:
        while len(engine.scheduler.waiting) < slots:
            engine.add_request(prompts[added % len(prompts)], params[added % len(prompts)],
                               request_id=f"saturated-{id(llm)}-{added}")
            added += 1
        step = engine.run_step()
        engine.outbox.take_for_step()
        now = time.perf_counter()
        if now >= end:
            break
        if step.started_at >= warm_until:
            tokens += step.num_sampled
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.outbox.take_for_step()
    return tokens / seconds


def batch_of(engines: dict[str, LLM], prompts: list[list[int]], params: list[SamplingParams], rounds: int,
             seconds: float) -> dict:
    """Each engine's saturated output rate (`saturated_rate`), back to back in each round, their
    order alternating by round; the medians of rounds, and the speedup as the median of each
    round's ratio (the machine drifts between rounds by more than between two windows)."""
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for round_index in range(rounds):
        for name, llm in in_turn(engines, round_index):
            rates[name].append(saturated_rate(llm, prompts, params, seconds))
    result = {f"{name}_tok_s": statistics.median(r) for name, r in rates.items()}
    result |= {f"{name}_tok_s_by_round": r for name, r in rates.items()}
    result["speedup"] = statistics.median(s / p for s, p in zip(rates["speculative"], rates["plain"]))
    slots = engines["plain"].config.max_num_seqs
    result["max_num_seqs"] = slots
    print(f"  batch {slots} (kept full): {result['plain_tok_s']:.1f} -> {result['speculative_tok_s']:.1f} tok/s "
          f"({result['speedup']:.2f}x)", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=None, help="ngram: default the engine's")
    parser.add_argument("--prompt-lookup-min", type=int, default=None, help="ngram: default the engine's")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-sizes", default="16", help="mixed batches to measure (comma-separated)")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window of each batch run")
    parser.add_argument("--disable-by-batch-size", type=int, default=0, help="0: no cap (the default)")
    parser.add_argument("--method", default="ngram", choices=["ngram", "draft_model"])
    parser.add_argument("--draft-model", default=None, help="draft_model: default the model itself")
    parser.add_argument("--draft-quantization", default="int4", help="draft_model: int8, int4 or none")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    common = dict(compile_mode="blocking", enforce_eager=False, max_num_seqs=32, quantization=args.quantization)
    plain = LLM(args.model, **common)
    spec_config = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens,
                   "disable_by_batch_size": args.disable_by_batch_size or None}
    for key in ("prompt_lookup_max", "prompt_lookup_min"):
        if getattr(args, key) is not None:
            spec_config[key] = getattr(args, key)
    if args.method == "draft_model":
        quantization = None if args.draft_quantization == "none" else args.draft_quantization
        spec_config |= {"model": args.draft_model or plain.config.model, "quantization": quantization}
    engines = {"plain": plain, "speculative": LLM(args.model, speculative_config=spec_config, **common)}
    tokenizer = engines["plain"].engine.tokenizer
    ids = {label: chat_token_ids(tokenizer, [{"role": "user", "content": text}])
           for label, text in {**COPY, **FREE}.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    for llm in engines.values():  # compile every graph a step of either kind needs
        llm.generate(list(ids.values()), warm, use_tqdm=False)
        llm.generate([ids["repeat"]], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    results = {"model": engines["plain"].config.model, "quantization": args.quantization,
               "speculative_config": engines["speculative"].config.speculative_config,
               "max_tokens": args.max_tokens, "rounds": args.rounds}
    print("batch 1, decode tok/s without -> with speculation:")
    results["batch_1"] = batch_one(engines, ids, params, args.rounds)
    for kind, labels in (("copy", COPY), ("free", FREE)):
        speedups = [results["batch_1"][label]["speedup"] for label in labels]
        results[f"batch_1_{kind}_median_speedup"] = statistics.median(speedups)
        print(f"  {kind}: median {statistics.median(speedups):.2f}x")
    mixed = [ids[label] for label in (*COPY, *FREE)]
    # Each size kept full (requests always waiting for a slot), so neither engine runs a tail of
    # a few last requests. Each prompt makes a fixed number of tokens (ignore_eos) in both engines,
    # from max_tokens / 2 to max_tokens, so requests end at different steps in both.
    lengths = [args.max_tokens // 2 + i * (args.max_tokens // 2) // (len(mixed) - 1) for i in range(len(mixed))]
    fixed = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    for size in (int(b) for b in args.batch_sizes.split(",") if b):
        engines.clear()  # the previous pair's memory goes before the next pair's
        sized = dict(common, max_num_seqs=size)
        engines = {"plain": LLM(args.model, **sized), "speculative": LLM(args.model, speculative_config=spec_config,
                                                                       **sized)}
        results[f"batch_{size}"] = batch_of(engines, mixed, fixed, args.rounds, args.seconds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
