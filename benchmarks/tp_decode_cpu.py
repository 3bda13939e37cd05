"""CPU decode step time with tensor_parallel_size=2 against 1, and what the collectives cost.

    python -m benchmarks.tp_decode_cpu [--preset qwen3-0.6b] [--batch 1 8] [--steps 32] [--repeats 3]

For each batch size: the engine's decode step (dummy fp32 weights, gloo on CPU) measured as
(time of a generate with `steps + 1` tokens - time of one with 1 token) / steps, the median of
`--repeats`; then two spawned ranks, one thread each as the engine gives them, running only
the collectives one tp=2 decode step makes (the step broadcast, the embedding's all-reduce, two
all-reduces a layer, the LM head's all-gather) on tensors of the step's shapes. Prints one JSON
line per batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastgen import LLM, SamplingParams
from fastgen.models.presets import preset_config, preset_model_dir


def engine_step_ms(model_dir: str, tp: int, batch: int, steps: int, repeats: int) -> float:
    llm = LLM(model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="float32", tensor_parallel_size=tp,
              max_model_len=128, num_kv_blocks=batch * 8 + 8, block_size=16, max_num_seqs=batch)
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(32)] for i in range(batch)]

    def timed(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - start

    timed(2)  # warm-up
    samples = [(timed(steps + 1) - timed(1)) / steps for _ in range(repeats)]
    llm.shutdown()
    return 1e3 * statistics.median(samples)


def _collectives_rank(rank: int, port: int, shapes: dict, steps: int, repeats: int, result) -> None:
    from fastgen.parallel.group import TensorParallelGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tp = TensorParallelGroup(rank, 2, None)
    hidden = torch.randn(shapes["batch"], shapes["hidden"])
    logits = torch.randn(shapes["batch"], shapes["vocab_per_rank"])
    header = torch.zeros(10, dtype=torch.int64)
    payload = torch.zeros(shapes["payload"], dtype=torch.int64)

    def one_step() -> None:
        dist.broadcast(header, src=0)
        dist.broadcast(payload, src=0)
        for _ in range(1 + 2 * shapes["layers"]):
            tp.all_reduce(hidden)
        tp.gather_last_dim(logits)

    for _ in range(3):
        one_step()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            one_step()
        samples.append((time.perf_counter() - start) / steps)
    if rank == 0:
        result.put(1e3 * statistics.median(samples))
    dist.destroy_process_group()


def collectives_step_ms(config: dict, batch: int, steps: int, repeats: int) -> float:
    shapes = dict(batch=batch, hidden=config["hidden_size"], layers=config["num_hidden_layers"],
                  vocab_per_rank=-(-config["vocab_size"] // 2), payload=batch * (4 + 128 // 16))
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=_collectives_rank, args=(r, port, shapes, steps, repeats, result)) for r in (0, 1)]
    for p in procs:
        p.start()
    value = result.get(timeout=600)
    for p in procs:
        p.join()
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir, config = str(preset_model_dir(args.preset)), preset_config(args.preset)
    for batch in args.batch:
        tp1 = engine_step_ms(model_dir, 1, batch, args.steps, args.repeats)
        tp2 = engine_step_ms(model_dir, 2, batch, args.steps, args.repeats)
        comm = collectives_step_ms(config, batch, args.steps * 4, args.repeats)
        print(json.dumps(dict(preset=args.preset, batch=batch, cores=os.cpu_count(), tp1_step_ms=round(tp1, 2),
                              tp2_step_ms=round(tp2, 2), tp2_over_tp1=round(tp2 / tp1, 3),
                              tp2_collectives_only_ms=round(comm, 3),
                              collectives_share_of_tp2=round(comm / tp2, 3))), flush=True)


if __name__ == "__main__":
    main()
