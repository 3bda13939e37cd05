"""The synthetic bench workload: reproducible from its seed, within its ranges."""

from __future__ import annotations

from fastgen.bench.workload import IntRange, WorkloadSpec, build_workload, token_id_range


def test_workload_is_reproducible_and_respects_the_ranges():
    spec = WorkloadSpec(50, IntRange(3, 9), IntRange(1, 5), prefix_len=7, seed=11)
    a, b = build_workload(spec, 49152), build_workload(spec, 49152)
    assert a.prompts == b.prompts and a.output_lens == b.output_lens
    low, high = token_id_range(49152)
    assert all(low <= t < high for p in a.prompts for t in p)
    assert all(p[:7] == a.prompts[0][:7] for p in a.prompts)
    assert {len(p) - 7 for p in a.prompts} <= set(range(3, 10)) and {1, 5} <= set(a.output_lens)
    assert all(sp.ignore_eos and sp.max_tokens == n for sp, n in zip(a.sampling_params(0.0), a.output_lens))
    assert build_workload(WorkloadSpec(50, IntRange(3, 9), IntRange(1, 5), 7, seed=12), 49152).prompts != a.prompts


def test_a_round_with_fresh_tokens_keeps_every_length_and_shares_no_prompt():
    from fastgen.bench.workload import with_fresh_tokens

    first = build_workload(WorkloadSpec(6, IntRange(3, 20), IntRange(2, 9), prefix_len=4, seed=5), 1000)
    again = with_fresh_tokens(first, 6, 1000)
    assert [len(p) for p in again.prompts] == [len(p) for p in first.prompts]
    assert again.output_lens == first.output_lens
    assert len({tuple(p[:4]) for p in again.prompts}) == 1  # one shared prefix, as drawn
    assert again.prompts[0][:4] != first.prompts[0][:4]  # (no prefix-cache hit on the round before)
    assert with_fresh_tokens(first, 6, 1000).prompts == again.prompts
