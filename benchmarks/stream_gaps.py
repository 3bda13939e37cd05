"""How long a running stream stalls while another request's long text prompt is added.

One AsyncLLM streams a greedy answer; once it has made 30 tokens, a second request with a long
text prompt (and one output token) is submitted on the same event loop. The stream's largest gap
between two tokens from then until the second request ends is reported, for the prompt as text
and as token ids. The prompt was added once before (the warm-up), so its blocks come from the
prefix cache, as a long system prompt's do in a chat service: what is left is the host's work
on it, tokenizing and checking it. (Computed afresh, its chunks' steps set the largest gap
instead.) The model is a two-layer Llama with the default model's tokenizer, so that steps take
about as long as a GPU's and the host's share shows.

Usage: python benchmarks/stream_gaps.py [--root CHECKOUT ...] [--rounds N] [--prompt-chars C] [--json PATH]
Each round runs one fresh process per checkout, in turn (default: this one), from CHECKOUT as the
working directory, so two trees are compared with one command and one interpreter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import asyncio, json, random, shutil, statistics, sys, tempfile, time
from pathlib import Path
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from fastgen import LLM, SamplingParams
from fastgen.engine.async_llm import AsyncLLM
from fastgen.models.default_model import default_model_path

prompt_chars = int(sys.argv[1])
source = default_model_path()
folder = Path(tempfile.mkdtemp())
torch.manual_seed(0)
config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                     tie_word_embeddings=True)
LlamaForCausalLM(config).save_pretrained(folder)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(source / name, folder / name)
random.seed(0)
words = ("the engine streams tokens while a long prompt arrives; paged blocks, prefix caching, "
         "Grüße aus Köln, 3.14159 and 42 are words too. def f(x): return x ** 2 # square").split()
text = " ".join(random.choice(words) for _ in range(prompt_chars))[:prompt_chars]

async def gaps_while_added(engine, prompt):
    gaps, last = [], None
    async def stream():
        nonlocal last
        params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0)
        async for _ in engine.generate_async("Tell me a story", params):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    task = asyncio.create_task(stream())
    while len(gaps) < 30:
        if task.done():
            task.result()  # (its error, or a stream that ended too soon)
            raise RuntimeError("the stream ended before 30 tokens")
        await asyncio.sleep(0.0005)
    before = statistics.median(gaps)
    start = len(gaps)
    async for _ in engine.generate_async(prompt, SamplingParams(max_tokens=1)):
        pass
    # the gap under way when the prompt ended counts too
    while len(gaps) == start and not task.done():
        await asyncio.sleep(0.0005)
    worst = max(gaps[start:])
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return worst * 1000, before * 1000

async def main():
    llm = LLM(str(folder), max_model_len=16384, enforce_eager=True, dtype="float32")
    ids = llm.tokenizer.encode(text)
    engine = AsyncLLM(llm)
    results = {"prompt_tokens": len(ids)}
    try:
        for name, prompt in (("warm-up", text), ("text", text), ("ids", ids)):
            worst, median = await gaps_while_added(engine, prompt)
            results[name] = {"largest_gap_ms": worst, "median_gap_before_ms": median}
    finally:
        engine.shutdown()
    print(json.dumps(results))

asyncio.run(main())
"""


def run_once(root: Path, prompt_chars: int) -> dict:
    child = subprocess.run([sys.executable, "-c", _CHILD, str(prompt_chars)], cwd=root, capture_output=True,
                           text=True)
    if child.returncode != 0:
        raise SystemExit(f"the measurement in {root} failed:\n{child.stderr[-3000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, action="append", help="checkout to measure (repeatable)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-chars", type=int, default=28_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    roots = args.root or [ROOT]
    runs: dict[str, list[dict]] = {str(r): [] for r in roots}
    for _ in range(args.rounds):
        for root in roots:
            runs[str(root)].append(run_once(root, args.prompt_chars))
    report = {}
    for root, results in runs.items():
        row = {"prompt_tokens": results[0]["prompt_tokens"]}
        for kind in ("text", "ids"):
            row[f"{kind}_largest_gap_ms"] = statistics.median(r[kind]["largest_gap_ms"] for r in results)
        row["median_gap_ms"] = statistics.median(r["text"]["median_gap_before_ms"] for r in results)
        report[root] = row
        print(f"{root}: {row['prompt_tokens']:,}-token prompt added; the stream's largest gap "
              f"{row['text_largest_gap_ms']:.1f} ms as text, {row['ids_largest_gap_ms']:.1f} ms as token ids "
              f"(median gap before {row['median_gap_ms']:.2f} ms; medians of {len(results)} processes)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
