"""KV-cache sizing: which budget wins, and the shape of the profiling step (plain arithmetic; the
profiling itself needs a GPU)."""

from __future__ import annotations

import pytest

from fastgen.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from fastgen.worker.kv_cache import bytes_per_block, check_fits_one_sequence, num_blocks_for_budget
from fastgen.worker.kv_cache import peak_prefill_lengths


@pytest.fixture
def config_for(tiny_models):
    def make(**kwargs) -> EngineConfig:
        return EngineConfig(model=tiny_models["qwen3"], **kwargs)

    return make


def test_measured_zero_budget_stays_zero_and_fails_the_fit_check(config_for):
    config = config_for(block_size=16, max_model_len=256)
    assert num_blocks_for_budget(config, 0) == 0
    with pytest.raises(ValueError, match="holds 0 blocks"):
        check_fits_one_sequence(config, 0)


def test_budget_precedence(config_for):
    config = config_for(block_size=16)
    per_block = bytes_per_block(config)
    assert num_blocks_for_budget(config, None) == DEFAULT_CPU_KV_CACHE_BYTES // per_block
    assert num_blocks_for_budget(config, 10 * per_block) == 10
    assert num_blocks_for_budget(config_for(block_size=16, kv_cache_memory_bytes=3 * per_block), 10 * per_block) == 3
    assert num_blocks_for_budget(config_for(block_size=16, num_kv_blocks=7), 10 * per_block) == 7


@pytest.mark.parametrize(
    ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "expected"),
    [
        (256, 1000, 400, [400, 400, 200]),  # fills the token budget
        (2, 1000, 300, [300, 300]),  # never more sequences than a step holds
        (8, 256, 1024, [256]),  # a chunk of one long prompt
    ],
)
def test_profiling_prefill_is_the_largest_step_the_scheduler_can_form(
    config_for, max_num_seqs, max_num_batched_tokens, max_model_len, expected
):
    config = config_for(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len)
    assert peak_prefill_lengths(config) == expected
