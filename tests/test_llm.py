"""LLM's own arguments: flags that must be booleans are booleans."""

from __future__ import annotations

import pytest

from fastgen import LLM, SamplingParams


@pytest.mark.parametrize("value", ["no", 0, None])
def test_skip_tokenizer_init_must_be_a_boolean(tiny_models, value):
    with pytest.raises(ValueError, match=rf"skip_tokenizer_init={value!r} must be True or False"):
        LLM(tiny_models["qwen3"], skip_tokenizer_init=value)


@pytest.mark.parametrize("field, value", [("enable_prefix_caching", "no"), ("enforce_eager", "false"),
                                          ("use_torch_compile", 1)])
def test_engine_flags_must_be_booleans(tiny_models, field, value):
    with pytest.raises(ValueError, match=rf"{field}={value!r} must be True or False"):
        LLM(tiny_models["qwen3"], **{field: value})


def test_use_tqdm_must_be_a_boolean(tiny_models):
    llm = LLM(tiny_models["qwen3"], dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match=r"use_tqdm='no' must be True or False"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=1), use_tqdm="no")
    assert not llm.engine.has_unfinished_requests()
