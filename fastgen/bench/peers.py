"""The same workload through another library, for a ratio measured in the same run.

transformers: `generate(do_sample=False)` on the model folder's real weights, in the engine's
dtype, in fixed batches with left padding (what a static-batch library must do), every request of
a batch generating the batch's longest output. llama.cpp (through llama-cpp-python, when it is
importable): a GGUF of the same model, one sequence at a time, greedy by argmax of its logits.
Both run on this process's torch thread count. Only the tokens the workload asked for count.
"""

from __future__ import annotations

import importlib.util
import time

import torch

from fastgen.bench.stats import median

PEERS = ("transformers", "llama.cpp")


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # every prompt ends at the last column
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


class TransformersPeer:
    """A transformers model on the CPU in `dtype`, generating exactly the asked lengths."""

    name = "transformers"

    def __init__(self, model_dir: str, dtype: torch.dtype):
        import transformers

        self.version = transformers.__version__
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.model.generation_config.eos_token_id = None  # run every request to its length
        self.model.generation_config.pad_token_id = 0

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        ids, mask = _left_padded(prompts)
        self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, disable_compile=True)

    def throughput(self, prompts: list[list[int]], output_lens: list[int], batch_size: int) -> dict:
        """Output tokens/s over the whole workload, in batches of `batch_size` in input order."""
        self.generate(prompts[:1], 2)  # warm-up
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            self.generate(prompts[i : i + batch_size], max(output_lens[i : i + batch_size]))
        elapsed = time.perf_counter() - start
        tokens = sum(output_lens)
        return {"backend": self.name, "version": self.version, "batch_size": batch_size, "elapsed_s": elapsed,
                "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed}

    def warm_up(self, prompts: list[list[int]]) -> None:
        self.generate(prompts, 2)

    def decode_once(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        """(prefill seconds, decode seconds) of one batch: a one-token generate, and a whole
        generate minus it."""
        start = time.perf_counter()
        self.generate(prompts, 1)
        first = time.perf_counter() - start
        start = time.perf_counter()
        self.generate(prompts, new_tokens)
        return first, time.perf_counter() - start - first


class LlamaCppPeer:
    """A GGUF through llama-cpp-python; one sequence at a time."""

    name = "llama.cpp"

    def __init__(self, gguf_path: str, context_len: int):
        import llama_cpp

        self.version = llama_cpp.__version__
        threads = torch.get_num_threads()
        self.llm = llama_cpp.Llama(gguf_path, n_ctx=context_len, n_threads=threads, n_threads_batch=threads,
                                   n_batch=min(context_len, 512), verbose=False)

    def warm_up(self, prompts: list[list[int]]) -> None:
        self.decode_once(prompts, 2)

    def decode_once(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        """(prefill seconds, decode seconds) of one greedy request."""
        import numpy as np

        if len(prompts) != 1:
            raise ValueError(f"--batch-size={len(prompts)}: the llama.cpp peer runs batch 1 only")
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompts[0])
        prefilled = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.llm.eval([int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))])
        return prefilled - start, time.perf_counter() - prefilled


def load_peers(names: list[str], llm, gguf: str | None, context_len: int) -> list:
    """The peers named (`PEERS`), for the workload of `llm` (a `fastgen.LLM`): transformers on
    its model folder in its dtype, llama.cpp on the GGUF file with a context of context_len."""
    return [TransformersPeer(llm.config.model, llm.config.torch_dtype) if name == "transformers"
            else LlamaCppPeer(gguf, context_len) for name in names]


def decode_summary(peer, runs: list[tuple[float, float]], batch_size: int, new_tokens: int) -> dict:
    """A peer's decode tokens/s and prefill ms from its `decode_once` runs (medians)."""
    return {"backend": peer.name, "version": peer.version,
            "decode_tokens_per_s": batch_size * (new_tokens - 1) / median([d for _, d in runs]),
            "prefill_ms": median([p for p, _ in runs]) * 1000.0}
