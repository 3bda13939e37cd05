"""The sampler on a Qwen-sized vocabulary, CPU, float32 logits (group `sampler`).

Sampler.__call__ as the runner calls it: per-row parameter tensors, exponential noise, then the
eager `sample_tokens` (torch.compile is off on CPU by default). Greedy runs at batch 1 and 256.
Temperature and the mixed top-k/top-p batch run at batch 1 and 16, not 256: on this 2-core
machine a 256 x 151,936 batch takes about 1.3-1.8 s (temperature: the exponential noise) and
4-5.5 s (top-k/top-p: the full-vocabulary sort) per call, far too slow for a regression suite's rounds,
and the cost is linear in the batch (extra_info["per_row_ms"] gives the per-row figure).
"""

from __future__ import annotations

import pytest
import torch

from fastgen.compile import build_op_set
from fastgen.worker.sampler import Sampler
from fastgen.sampling_params import SamplingParams
from fastgen.engine.sequence import Sequence

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

CASES = [
    pytest.param(GREEDY, 1, id="greedy-batch1"),
    pytest.param(GREEDY, 256, id="greedy-batch256"),
    pytest.param(TEMPERATURE, 1, id="temperature-batch1"),
    pytest.param(TEMPERATURE, 16, id="temperature-batch16"),
    pytest.param(MIXED, 1, id="topk-topp-mixed-batch1"),
    pytest.param(MIXED, 16, id="topk-topp-mixed-batch16"),
]


@pytest.mark.benchmark(group="sampler")
@pytest.mark.parametrize("params, batch", CASES)
def test_sampler(benchmark, params, batch):
    device = torch.device("cpu")
    sampler = Sampler(VOCAB, device, seed=0, sample_fn=build_op_set(False).sample_tokens)
    seqs = [Sequence(i, [1], params[i % len(params)]) for i in range(batch)]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, VOCAB, generator=gen) * 4.0
    benchmark.extra_info.update(batch=batch, vocab=VOCAB, threads=torch.get_num_threads())
    tokens = benchmark(sampler, logits, seqs)
    assert tokens.shape == (batch,) and tokens.dtype == torch.int64
    assert int(tokens.min()) >= 0 and int(tokens.max()) < VOCAB
    if benchmark.stats is not None:
        benchmark.extra_info["per_row_ms"] = round(benchmark.stats.stats.median * 1e3 / batch, 4)
