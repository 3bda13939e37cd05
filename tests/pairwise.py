"""Which cases of a parametrized product `make test` runs: a set that holds every pair of two
axes' values (all-pairs), the other cases marked slow for test-slow and `make gpu-test`.

A kernel's arguments interact mostly two at a time (a block size with a group size, a dtype with
a head dim), so the pairs find what the whole product finds, at a fraction of its cases, where
each case is a kernel run under the Triton interpreter.
"""

from __future__ import annotations

import itertools

import pytest


def all_pairs_in_make_test(*axes: dict[str, tuple]) -> list:
    """pytest params for the product of `axes` (each maps an id to the arguments it sets, in the
    order of the parametrized names), ids joined with "-". The greedy all-pairs choice is
    deterministic: each pick is the case that covers the most pairs not yet covered, the first
    such in product order."""
    assert len(axes) >= 2, "pairs need two axes"
    cases = list(itertools.product(*(list(axis.items()) for axis in axes)))

    def pairs(case) -> set:
        return {(i, case[i][0], j, case[j][0]) for i, j in itertools.combinations(range(len(case)), 2)}

    uncovered = set().union(*(pairs(case) for case in cases))
    chosen: set[int] = set()
    while uncovered:
        best = max(range(len(cases)), key=lambda n: (len(pairs(cases[n]) & uncovered), -n))
        chosen.add(best)
        uncovered -= pairs(cases[best])
    return [pytest.param(*(arg for _, args in case for arg in args), id="-".join(name for name, _ in case),
                         marks=() if n in chosen else pytest.mark.slow)
            for n, case in enumerate(cases)]
