"""The warm-up's time estimate of a workload, medians, and the decode rate a latency report gives."""

from __future__ import annotations

import pytest

from fastgen.bench.runner import WarmUpTimes
from fastgen.bench.workload import IntRange, WorkloadSpec, build_workload


def test_estimate_is_prompt_tokens_at_the_prefill_rate_plus_decode_steps():
    workload = build_workload(WorkloadSpec(10, IntRange(100, 100), IntRange(50, 50)), 1000)
    warm = WarmUpTimes(prefill_s_per_token=0.001, decode_step_s=0.02)
    # 1000 prompt tokens; 500 output tokens in batches of 4 -> 125 decode steps.
    assert warm.estimate_seconds(workload, max_num_seqs=4) == pytest.approx(1.0 + 125 * 0.02)
    # A batch wider than the workload runs every request at once: 50 steps.
    assert warm.estimate_seconds(workload, max_num_seqs=256) == pytest.approx(1.0 + 50 * 0.02)


def test_median_of_an_even_count_is_the_mean_and_the_reported_sample_the_lower_middle():
    from fastgen.bench.stats import median, median_index

    assert median([3.0, 1.0, 4.0, 2.0]) == 2.5 and median([5.0, 1.0, 3.0]) == 3.0
    assert median_index([3.0, 1.0, 4.0, 2.0]) == 3  # 2.0, not the flattering 3.0
    assert median_index([5.0, 1.0, 3.0]) == 2


def test_the_decode_rate_is_the_batch_over_the_median_step_the_report_gives():
    """Of an even count of steps, the median is the mean of the two middle ones, as
    decode_step_ms.p50 has it."""
    from types import SimpleNamespace

    from fastgen.bench.latency import _decode_rate
    from fastgen.bench.stats import summarize_ms

    steps = [0.001, 0.003, 0.002, 0.004]
    measured = [SimpleNamespace(decode_steps=steps, decode_step_tokens=[4] * 4)]
    assert _decode_rate(4, measured) == pytest.approx(4 / (summarize_ms(steps)["p50"] / 1000))
    assert _decode_rate(4, measured) == pytest.approx(4 / 0.0025)
