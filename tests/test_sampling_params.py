"""SamplingParams: every field checked against what the sampler can represent, booleans that
are booleans, plain Python values in what passes, and unknown fields named."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from fastgen import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("temperature", [10**400, 1e39, -(10**400), float("inf")],
                         ids=["10**400", "1e39", "-10**400", "inf"])
def test_a_temperature_float32_cannot_hold_is_a_value_error(temperature):
    # 10**400 used to escape as OverflowError; 1e39 passed and became inf in the sampler.
    with pytest.raises(ValueError, match=r"temperature=.* must be a finite number in \[0, 3.4e38\] \(float32\)"):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("top_p", [10**400, -(10**400), float("nan")], ids=["10**400", "-10**400", "nan"])
def test_a_top_p_beyond_float_range_is_a_value_error(top_p):
    with pytest.raises(ValueError, match=r"top_p=.* must be in \(0, 1\]"):
        SamplingParams(top_p=top_p)


@pytest.mark.parametrize("value", [None, "no", "false", 0, 1, 1.0, np.bool_(True)])
def test_ignore_eos_must_be_a_boolean(value):
    with pytest.raises(ValueError, match=rf"ignore_eos={value!r} must be True or False"):
        SamplingParams(ignore_eos=value)


@pytest.mark.parametrize("kwargs", [dict(top_k=True), dict(max_tokens=True), dict(seed=False),
                                    dict(stop_token_ids=[True]), dict(top_k=2.0), dict(max_tokens="8")])
def test_integers_must_be_integers(kwargs):
    with pytest.raises(ValueError, match=rf"{next(iter(kwargs))}.* must be"):
        SamplingParams(**kwargs)


def test_a_top_k_beyond_int64_is_accepted_as_keep_all():
    # Clamped to the vocabulary by the sampler (tests/worker/test_sampler.py), not refused.
    assert SamplingParams(top_k=2**70).top_k == 2**70


def test_numpy_numbers_become_plain_python_numbers():
    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(5), top_p=np.float64(0.9),
                            max_tokens=np.int32(7), seed=np.uint64(3), stop_token_ids=np.array([4, 5]))
    assert (type(params.temperature), type(params.top_k), type(params.top_p)) == (float, int, float)
    assert type(params.max_tokens) is int and type(params.seed) is int
    assert params.stop_token_ids == [4, 5] and all(type(t) is int for t in params.stop_token_ids)


def test_a_validated_copy_shares_nothing_with_the_original():
    original = SamplingParams(max_tokens=8, stop=["a"], stop_token_ids=[3])
    copy = original.validated_copy()
    original.max_tokens, original.stop[0], original.stop_token_ids[0] = 2, "b", 4
    assert (copy.max_tokens, copy.stop, copy.stop_token_ids) == (8, ["a"], [3])


def test_a_validated_copy_checks_fields_changed_after_construction():
    params = SamplingParams()
    params.ignore_eos = "yes"
    with pytest.raises(ValueError, match=r"ignore_eos='yes' must be True or False"):
        params.validated_copy()


@pytest.mark.parametrize("cls, field", [(SamplingParams, "best_of"), (SamplingParams, "include_stop_str_in_output"),
                                        (StructuredOutputsParams, "guided_json")])
def test_an_unknown_field_is_a_value_error_listing_the_known_ones(cls, field):
    with pytest.raises(ValueError, match=rf"{cls.__name__} has no field\(s\) \['{field}'\]; known: \[.*'max_tokens'"
                       if cls is SamplingParams else rf"has no field\(s\) \['{field}'\]; known: \['json'"):
        cls(**{field: 1})
    assert "max_tokens" in str(inspect.signature(SamplingParams))  # the check hides no field


def test_none_for_stop_and_stop_token_ids_means_none_as_in_vllm():
    params = SamplingParams(stop=None, stop_token_ids=None).validated_copy()
    assert (params.stop, params.stop_token_ids) == ([], [])
