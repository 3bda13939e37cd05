"""Prompt-lookup speculative decoding on a GPU at a preset's shapes (Qwen3-0.6B, dummy weights):
batch-1 decode speed with drafts and without, the engines back to back on each prompt
(`speculative_decoding.batch_one`). Also the `speculative` section of `gpu_decode.py`
(`make gpu-bench`).

Random weights write whatever the model falls into, so the acceptance is that model's, not a
workload's. Two prompts: random tokens, and a random passage repeated (lookup finds drafts in
it). What carries over to real weights is the cost side: a verify step's time against a decode
step's, which the ratio at a given acceptance shows. One JSON:

    python3 benchmarks/gpu_speculative.py [--output FILE] [--num-speculative-tokens 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.speculative_decoding import batch_one  # noqa: E402
from fastgen import LLM, SamplingParams  # noqa: E402
from fastgen.graphs import runner as graph_runner  # noqa: E402
from fastgen.models.presets import preset_model_dir  # noqa: E402


def measure_speculation(preset: str, device: str, num_speculative_tokens: int = 4, max_tokens: int = 256,
                        rounds: int = 2, verify_graphs: bool = True, dtype: str = "bfloat16") -> dict:
    """Batch-1 decode tok/s with and without prompt lookup (the engine's own lookup settings) on
    dummy weights of `preset`, each prompt's speedup and acceptance (`batch_one`); the engines'
    memory is given back before it returns."""
    captured = graph_runner.CAPTURE_VERIFY_STEPS
    graph_runner.CAPTURE_VERIFY_STEPS = verify_graphs
    try:
        return _measure(preset, device, num_speculative_tokens, max_tokens, rounds, verify_graphs, dtype)
    finally:
        graph_runner.CAPTURE_VERIFY_STEPS = captured
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _measure(preset: str, device: str, num_speculative_tokens: int, max_tokens: int, rounds: int,
             verify_graphs: bool, dtype: str) -> dict:
    model = str(preset_model_dir(preset))
    on_gpu = device.startswith("cuda")
    # On CPU (a smoke run) the cache holds the longest sequence, the repeated prompt's and its output.
    max_model_len = 2048 if on_gpu else 288 + max_tokens + 32
    common = dict(load_format="dummy", skip_tokenizer_init=True, device=device, dtype=dtype,
                  max_model_len=max_model_len, max_num_seqs=8, enforce_eager=not on_gpu, compile_mode="blocking",
                  block_size=256, num_kv_blocks=64 if on_gpu else -(-max_model_len // 256) + 1)
    engines = {"plain": LLM(model, **common),
               "speculative": LLM(model, speculative_config={"method": "ngram",
                                                             "num_speculative_tokens": num_speculative_tokens},
                                  **common)}
    rng = random.Random(0)
    passage = [rng.randrange(1000, 30000) for _ in range(48)]
    prompts = {"random": [rng.randrange(1000, 30000) for _ in range(256)], "repeated": passage * 6}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for llm in engines.values():  # compile and capture before timing
        llm.generate([prompts["random"][:16]], params, use_tqdm=False)
    rows = batch_one(engines, prompts, params, rounds)
    report = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "preset": preset, "weights": "dummy",
              "verify_graphs": "on" if verify_graphs else "off",
              "speculative_config": engines["speculative"].config.speculative_config, "max_tokens": max_tokens,
              "rounds": rounds, "batch_1": rows}
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda", help="cuda (the point); cpu only smoke-tests this script")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--verify-graphs", choices=("on", "off"), default="on",
                   help="verify steps replayed from CUDA graphs (the default) or run eagerly")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "gpu-speculative.json"))
    args = p.parse_args()
    report = measure_speculation(args.preset, args.device, args.num_speculative_tokens, args.max_tokens, args.rounds,
                                 args.verify_graphs == "on", args.dtype)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
