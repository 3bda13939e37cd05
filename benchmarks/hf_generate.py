"""The peer in the GPU benchmark: the same workload through transformers' `generate` on the same
GPU, batched the way a static-batch library must be (requests of similar output length
together, left-padded, every request of a batch running to the batch's longest output), with
its static KV cache and automatic torch.compile when that works, plain eager generate if not."""

from __future__ import annotations

import time

import torch

from fastgen.bench.workload import Workload


def _batches(workload: Workload, batch_size: int) -> list[list[int]]:
    order = sorted(range(len(workload.prompts)), key=lambda i: workload.output_lens[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _generate(model, workload: Workload, batch: list[int], device: str, compiled: bool, max_new: int | None = None):
    prompts = [workload.prompts[i] for i in batch]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding: every prompt ends at the last column
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    new = max_new or max(workload.output_lens[i] for i in batch)
    extra = dict(cache_implementation="static") if compiled else dict(disable_compile=True)
    model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                   max_new_tokens=new, min_new_tokens=new, **extra)
    return len(prompts) * new


@torch.inference_mode()
def transformers_throughput(model_dir: str, workload: Workload, device: str, dtype: torch.dtype,
                            batch_size: int = 64) -> dict:
    """Output tokens/s of `generate` on `workload` (random weights from the folder's config).
    Counts the tokens the workload asked for; tokens a request generates past its own length
    (to keep its batch together) are reported apart."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    batches = _batches(workload, batch_size)
    result = {"batch_size": batch_size, "num_batches": len(batches), "transformers": _version()}
    for compiled in ((True, False) if device.startswith("cuda") else (False,)):
        try:
            start = time.perf_counter()
            _generate(model, workload, batches[0], device, compiled, max_new=16)  # compile, autotune
            _sync(device)
            warmup = time.perf_counter() - start
            start, generated = time.perf_counter(), 0
            for batch in batches:
                generated += _generate(model, workload, batch, device, compiled)
            _sync(device)
            elapsed = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - recorded, then the eager path is measured instead
            result.setdefault("errors", []).append(f"{'static+compile' if compiled else 'eager'}: "
                                                   f"{type(exc).__name__}: {exc}"[:1000])
            continue
        return result | {
            "mode": "static cache + torch.compile" if compiled else "eager (dynamic cache)",
            "warmup_s": warmup, "elapsed_s": elapsed,
            "output_tokens": workload.num_output_tokens, "output_tokens_generated": generated,
            "output_tokens_per_s": workload.num_output_tokens / elapsed,
        }
    return result


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _version() -> str:
    import transformers

    return transformers.__version__
