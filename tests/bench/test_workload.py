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
