"""With temperature > 0, verifying drafts keeps the target distribution: the empirical
distribution of each output position, sampled with and without speculation (drafts proposed at
every step from a predicted output), passes a chi-square test of homogeneity. The drafts are the
model's most likely tokens, so both paths are taken often: drafts kept, and drafts rejected in
favour of the sample."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from fastgen import LLM, SamplingParams
from tests.conftest import random_prompts

NUM_SAMPLES = 4000
NEW_TOKENS = 4
Z_999 = 3.090  # the standard normal's 0.999 quantile


def chi_square_critical(df: int) -> float:
    """The chi-square distribution's 0.999 quantile (Wilson-Hilferty; within 1% for df >= 3)."""
    return df * (1 - 2 / (9 * df) + Z_999 * math.sqrt(2 / (9 * df))) ** 3


def homogeneity(a: Counter, b: Counter) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of two samples' counts, categories with
    fewer than 10 observations in both pooled into one."""
    pooled_a, pooled_b, rows = 0, 0, []
    for key in set(a) | set(b):
        if a[key] + b[key] < 10:
            pooled_a, pooled_b = pooled_a + a[key], pooled_b + b[key]
        else:
            rows.append((a[key], b[key]))
    if pooled_a + pooled_b:
        rows.append((pooled_a, pooled_b))
    n_a, n_b = sum(a.values()), sum(b.values())
    stat = 0.0
    for x, y in rows:
        total = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            expected = total * n / (n_a + n_b)
            stat += (observed - expected) ** 2 / expected
    return stat, len(rows) - 1


# Both drafters' tokens go through one verification, which this tests: test-slow adds the draft model.
@pytest.mark.parametrize("method", ["ngram", pytest.param("draft_model", marks=pytest.mark.slow)])
def test_sampling_with_drafts_keeps_the_distribution(tiny_models, method):
    """ngram: drafts from the predicted output; draft_model: the model itself drafts its greedy
    tokens."""
    model = tiny_models["llama"]
    prompt = random_prompts([10], seed=21)[0]
    common = dict(dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=1200, max_num_seqs=256)
    plain = LLM(model, **common)
    likely = plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    prediction = likely[0].token_ids
    speculative = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        speculative["model"] = model
    spec = LLM(model, speculative_config=speculative, **common)
    spec.engine.drafter.row_cost = 0.0  # draft at any batch size and rate: this tests verification

    def sample(llm: LLM, seed0: int) -> list[list[int]]:
        params = [SamplingParams(temperature=0.3, max_tokens=NEW_TOKENS, ignore_eos=True, seed=seed0 + i,
                                 prediction=prediction) for i in range(NUM_SAMPLES)]
        return [out.token_ids for out in llm.generate([prompt] * NUM_SAMPLES, params)]

    without, with_drafts = sample(plain, 0), sample(spec, 10**6)
    stats = spec.engine.stats()
    # Both branches of verification were taken many times.
    assert stats.accepted_draft_tokens > 500
    assert stats.draft_tokens - stats.accepted_draft_tokens > 500
    for position in range(NEW_TOKENS):
        # The token at `position` together with the one before it: a verification that kept a
        # wrong draft, or sampled the correction from the wrong distribution, shows there.
        a = Counter(tuple(t[max(0, position - 1): position + 1]) for t in without)
        b = Counter(tuple(t[max(0, position - 1): position + 1]) for t in with_drafts)
        stat, df = homogeneity(a, b)
        assert df >= 3, (position, a, b)
        assert stat < chi_square_critical(df), (position, stat, df)
