"""The sampler on a Qwen-sized vocabulary, CPU, float32 logits (group `sampler`).

Sampler.__call__ as the runner calls it: per-row parameter tensors, exponential noise, then the
eager `sample_tokens` (torch.compile is off on CPU by default). Greedy runs at batch 1 and 256.
Temperature and the mixed top-k/top-p batch run at batch 1 and 16, not 256: on a 2-core
machine a 256 x 151,936 batch of sampled rows takes about a second per call (each row's noise,
softmax and, where its nucleus is wide, a sort of the vocabulary), too slow for a regression
suite's rounds, and the cost is linear in the sampled rows (extra_info["per_row_ms"] gives the
per-row figure). `one-sampled-in-greedy-batch32` is a greedy batch with one top-p request.

Penalties + logprobs (every row with presence, frequency and repetition penalties and 5
logprobs) time what the runner does for a step: the sampler call, then the logprobs of the
sampled tokens, then the tokens to the host; `temperature-step` times the same for plain
temperature rows, its peer. Those two also run at batch 256, in 5 pedantic rounds (a call
there takes seconds on CPU).
"""

from __future__ import annotations

import pytest
import torch

from fastgen.compile import build_op_set
from fastgen.sampling_params import SamplingParams
from fastgen.sequence import Sequence
from fastgen.worker.sampler import Sampler
from fastgen.worker.top_logprobs import sampled_logprobs

VOCAB = 151_936

GREEDY = [SamplingParams(temperature=0.0)]
TEMPERATURE = [SamplingParams(temperature=0.8)]
# A serving batch: rows mixing greedy, plain temperature, top-k, top-p, both, and a seeded row.
MIXED = [
    SamplingParams(temperature=0.7, top_k=50),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.9, top_p=0.8, seed=1234),
]

# A greedy serving batch with one request that samples (top-p): what the greedy rows pay for it.
ONE_SAMPLED = [SamplingParams(temperature=0.8, top_p=0.9)] + [SamplingParams(temperature=0.0)] * 31

PENALTIES_LOGPROBS = [SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3,
                                     repetition_penalty=1.2, logprobs=5)]
PROMPT = list(range(1, 201))  # what repetition penalises besides the output
BATCH_256_ROUNDS = 5

CASES = [
    pytest.param(GREEDY, 1, id="greedy-batch1"),
    pytest.param(GREEDY, 256, id="greedy-batch256"),
    pytest.param(TEMPERATURE, 1, id="temperature-batch1"),
    pytest.param(TEMPERATURE, 16, id="temperature-batch16"),
    pytest.param(MIXED, 1, id="topk-topp-mixed-batch1"),
    pytest.param(MIXED, 16, id="topk-topp-mixed-batch16"),
    pytest.param(ONE_SAMPLED, 32, id="one-sampled-in-greedy-batch32"),
]


def make_batch(benchmark, params: list[SamplingParams], batch: int, prompt: list[int]):
    """A CPU sampler, `batch` one-prompt sequences cycling through `params`, and their logits."""
    sampler = Sampler(VOCAB, torch.device("cpu"), seed=0, sample_fn=build_op_set(False).sample_tokens)
    seqs = [Sequence(i, list(prompt), params[i % len(params)]) for i in range(batch)]
    logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(0)) * 4.0
    benchmark.extra_info.update(batch=batch, vocab=VOCAB, threads=torch.get_num_threads())
    return sampler, seqs, logits


def check_tokens(benchmark, tokens: list[int], batch: int) -> None:
    assert len(tokens) == batch and 0 <= min(tokens) and max(tokens) < VOCAB
    if benchmark.stats is not None:
        benchmark.extra_info["per_row_ms"] = round(benchmark.stats.stats.median * 1e3 / batch, 4)


@pytest.mark.benchmark(group="sampler")
@pytest.mark.parametrize("params, batch", CASES)
def test_sampler(benchmark, params, batch):
    sampler, seqs, logits = make_batch(benchmark, params, batch, [1])
    tokens = benchmark(sampler, logits, seqs)
    assert tokens.shape == (batch,) and tokens.dtype == torch.int64
    check_tokens(benchmark, tokens.tolist(), batch)


def sample_step(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """What ModelRunner.run does once it has the logits: sample, logprobs, tokens to the host."""
    tokens = sampler(logits, seqs)
    sampled_logprobs(logits, seqs, tokens)
    return tokens.tolist()


STEP_CASES = [
    pytest.param(TEMPERATURE, 16, id="temperature-step-batch16"),
    pytest.param(PENALTIES_LOGPROBS, 1, id="penalties-logprobs-batch1"),
    pytest.param(PENALTIES_LOGPROBS, 16, id="penalties-logprobs-batch16"),
    pytest.param(TEMPERATURE, 256, id="temperature-step-batch256"),
    pytest.param(PENALTIES_LOGPROBS, 256, id="penalties-logprobs-batch256"),
]


@pytest.mark.benchmark(group="sampler")
@pytest.mark.parametrize("params, batch", STEP_CASES)
def test_sample_step(benchmark, params, batch):
    sampler, seqs, logits = make_batch(benchmark, params, batch, PROMPT)
    if batch >= 256:
        tokens = benchmark.pedantic(sample_step, (sampler, logits, seqs), rounds=BATCH_256_ROUNDS, warmup_rounds=1)
    else:
        tokens = benchmark(sample_step, sampler, logits, seqs)
    check_tokens(benchmark, tokens, batch)
