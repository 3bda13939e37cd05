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


def test_steps_that_advance_part_of_the_batch_are_rated_by_the_tokens_they_made():
    """A batch of 4 under max_num_seqs=2 decodes 2 rows a step: its rate (and its speedup over a
    peer that decodes all 4 each step) counts the tokens the steps made, not the batch per step."""
    from types import SimpleNamespace

    from fastgen.bench.latency import LatencySpec, _decode_rate, peer_results

    measured = [SimpleNamespace(decode_steps=[0.002] * 10, decode_step_tokens=[2] * 10)]
    assert _decode_rate(4, measured) == pytest.approx(20 / 0.02)  # 1,000 tok/s, not 2,000
    spec = LatencySpec(batch_size=4, input_len=8, output_len=6, num_iters=1, num_iters_warmup=0, seed=0,
                       temperature=0.0)
    peer = SimpleNamespace(name="peer", version="1")
    (result,) = peer_results(spec, [peer], [[(0.01, 0.02)]], measured)  # 4 x 5 tokens in 0.02 s
    assert result["decode_tokens_per_s"] == pytest.approx(1000.0)
    assert result["fastgen_speedup"] == pytest.approx(1.0)


@pytest.mark.parametrize("chunked", [False, True], ids=["one-prefill-step", "prompts-over-several-steps"])
def test_each_decode_step_is_credited_with_its_own_tokens_with_the_overlap_on_or_off(tiny_models, chunked):
    """With the overlap on, a step's outputs are the step before's: the tokens credited to a
    decode step must still be its own, or a batch whose prompts took several steps is rated on
    the prefill's tokens (15 tokens for 12 made)."""
    import torch

    from fastgen import LLM
    from fastgen.bench.runner import run_iteration

    budget = dict(max_num_batched_tokens=40) if chunked else {}
    workload = build_workload(WorkloadSpec(4, IntRange(16, 16), IntRange(6, 6), seed=1), 384)
    credited = []
    for overlap in (False, True):
        llm = LLM(tiny_models["llama"], dtype="float32", block_size=16, num_kv_blocks=64, max_model_len=64,
                  overlap_scheduling=overlap, **budget)
        times = run_iteration(llm.engine, workload, 0.0, torch.device("cpu"))
        assert len(times.decode_step_tokens) == len(times.decode_steps)
        credited.append(times.decode_step_tokens)
    assert credited[0] == credited[1]
    assert (credited[0] == [4] * 5) is not chunked
