"""`make test`'s share of a parametrized product (`tests/pairwise.py`): every pair of two axes'
values in some case it runs, every case of the product in the list, the rest marked slow."""

from __future__ import annotations

import itertools

from tests.pairwise import all_pairs_in_make_test


def test_the_cases_in_make_test_hold_every_pair_and_the_rest_are_slow():
    axes = ({"a": (1,), "b": (2,), "c": (3,)}, {"x": ("x", 10), "y": ("y", 20)},
            {"p": (None,), "q": (0,), "r": (5,), "s": (7,)})
    params = all_pairs_in_make_test(*axes)
    assert len(params) == 3 * 2 * 4 and len({p.id for p in params}) == len(params)
    assert params[0].values == (1, "x", 10, None) and params[0].id == "a-x-p"
    fast = [p.id.split("-") for p in params if not p.marks]
    slow = [p for p in params if p.marks]
    assert all(mark.name == "slow" for p in slow for mark in p.marks)
    for (i, left), (j, right) in itertools.combinations(enumerate(axes), 2):
        for u, v in itertools.product(left, right):
            assert any(case[i] == u and case[j] == v for case in fast), (u, v)
    # Fewer than the product (here at least 3 x 4 = 12 are needed for the widest two axes).
    assert 12 <= len(fast) < len(params)
    assert all_pairs_in_make_test(*axes) == params  # the same choice every run
