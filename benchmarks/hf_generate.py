"""The peer in the GPU benchmark: the same workload through transformers' `generate` on the same
GPU, batched the way a static-batch library must be (requests of similar output length
together, left-padded, every request of a batch running to the batch's longest output), with
its static KV cache and automatic torch.compile when that works, plain eager generate if not.

Fair to the peer: its static cache is sized once for the workload's longest prompt plus its
longest output, so every batch decodes in the one compiled graph that the warm-up built (a
cache sized per batch would recompile inside the timed loop), and warm-up runs twice so a
recompile for dynamic sizes happens there too. Its batch-1 decode latency is measured the same
way, beside fastgen's decode step at batch 1."""

from __future__ import annotations

import time

import torch

from fastgen.bench.workload import Workload


def _batches(workload: Workload, batch_size: int) -> list[list[int]]:
    order = sorted(range(len(workload.prompts)), key=lambda i: workload.output_lens[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _generate(model, workload: Workload, batch: list[int], device: str, cache, max_new: int | None = None):
    prompts = [workload.prompts[i] for i in batch]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding: every prompt ends at the last column
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    new = max_new or max(workload.output_lens[i] for i in batch)
    if cache is not None:
        cache.reset()
    extra = dict(past_key_values=cache) if cache is not None else dict(disable_compile=True)
    model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                   max_new_tokens=new, min_new_tokens=new, **extra)
    return len(prompts) * new


@torch.inference_mode()
def transformers_throughput(model_dir: str, workload: Workload, device: str, dtype: torch.dtype,
                            batch_size: int = 64, latency_context: int = 512, latency_tokens: int = 128) -> dict:
    """Output tokens/s of `generate` on `workload` (random weights from the folder's config).
    Counts the tokens the workload asked for; tokens a request generates past its own length
    (to keep its batch together) are reported apart. On CUDA also the batch-1 decode latency
    at `latency_context` tokens (`latency`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    batches = _batches(workload, batch_size)
    result = {"batch_size": batch_size, "num_batches": len(batches), "transformers": _version()}
    cache_len = max(len(p) for p in workload.prompts) + max(workload.output_lens)
    for compiled in ((True, False) if device.startswith("cuda") else (False,)):
        try:
            # One static cache per batch size (the last batch may be smaller), each of the
            # workload's largest shape, reset between batches.
            caches = {n: StaticCache(config=config, max_cache_len=cache_len) if compiled else None
                      for n in {len(b) for b in batches}}
            start = time.perf_counter()
            for n, cache in caches.items():  # compile, autotune; twice, for any dynamic-shape recompile
                batch = next(b for b in batches if len(b) == n)
                _generate(model, workload, batch, device, cache, max_new=16)
                _generate(model, workload, batch, device, cache, max_new=24)
            _sync(device)
            warmup = time.perf_counter() - start
            start, generated = time.perf_counter(), 0
            for batch in batches:
                generated += _generate(model, workload, batch, device, caches[len(batch)])
            _sync(device)
            elapsed = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - recorded, then the eager path is measured instead
            result.setdefault("errors", []).append(f"{'static+compile' if compiled else 'eager'}: "
                                                   f"{type(exc).__name__}: {exc}"[:1000])
            continue
        if device.startswith("cuda"):
            try:
                result["latency"] = _decode_latency(model, config, device, compiled, latency_context, latency_tokens)
            except Exception as exc:  # noqa: BLE001 - the throughput just measured stays
                result["latency"] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
        return result | {
            "mode": "static cache + torch.compile" if compiled else "eager (dynamic cache)",
            "cache_len": cache_len if compiled else None,
            "warmup_s": warmup, "elapsed_s": elapsed,
            "output_tokens": workload.num_output_tokens, "output_tokens_generated": generated,
            "output_tokens_per_s": workload.num_output_tokens / elapsed,
        }
    return result


def _decode_latency(model, config, device: str, compiled: bool, context: int, tokens: int) -> dict:
    """Batch-1 decode: the median over 3 runs of (time of `tokens` new tokens - time of 1) / (tokens - 1),
    so the prompt's prefill is left out."""
    from transformers import StaticCache

    cache = StaticCache(config=config, max_cache_len=context + tokens) if compiled else None
    prompt = torch.randint(100, config.vocab_size - 300, (1, context), generator=torch.Generator().manual_seed(0))
    ids, mask = prompt.to(device), torch.ones_like(prompt).to(device)

    def run(new: int) -> float:
        if cache is not None:
            cache.reset()
        extra = dict(past_key_values=cache) if cache is not None else dict(disable_compile=True)
        _sync(device)
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                       **extra)
        _sync(device)
        return time.perf_counter() - start

    run(16), run(24)  # compile at this shape
    per_token = sorted((run(tokens) - run(1)) / (tokens - 1) for _ in range(3))
    return {"batch_size": 1, "context_len": context, "new_tokens": tokens, "ms_per_token": per_token[1] * 1e3,
            "runs_ms_per_token": [t * 1e3 for t in per_token]}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _version() -> str:
    import transformers

    return transformers.__version__
