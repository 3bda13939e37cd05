"""KV-cache sizing: which budget wins, and the shape of the profiling step (plain arithmetic; the
profiling itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from fastgen.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from fastgen.worker.kv_cache import bytes_per_block, check_fits_one_sequence, num_blocks_for_budget
from fastgen.worker.memory_profile import worst_prefill_step


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
    ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "chunks"),
    [
        (256, 1000, 400, [400, 346] + [1] * 254),  # the token budget over as many sequences as a step holds
        (2, 1000, 300, [300, 300]),  # never more sequences than a step holds
        (8, 256, 1024, [249] + [1] * 7),  # a chunk of one long prompt beside one-token prompts
        (1, 256, 1024, [256]),  # a later chunk of a long prompt, ending a max_model_len context
    ],
)
def test_profiled_prefill_is_the_worst_step_the_scheduler_can_form(
    config_for, max_num_seqs, max_num_batched_tokens, max_model_len, chunks
):
    config = config_for(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len)
    step = worst_prefill_step(config)
    assert step.is_prefill and step.num_new_tokens == chunks
    # Every sequence reaches its last token, so every one samples (the most logits rows) ...
    assert all(step.samples(i) for i in range(len(step.seqs)))
    # ... with top-k and top-p, but for the last row: greedy, it makes the sampled rows a copy.
    params = [s.params for s in step.seqs]
    assert all(not p.greedy and p.top_k and p.top_p < 1 for p in params[:-1])
    assert params[-1].greedy == (len(params) > 1)
    # ... and the first one attends over a full max_model_len context: its chunk follows a
    # cached history (what chunked prefill and prefix-cache hits run), with a full-width table.
    first = step.seqs[0]
    assert len(first) == max_model_len and first.num_computed_tokens == max_model_len - chunks[0]
    assert len(first.block_table) == config.max_blocks_per_seq


def test_memory_profile_runs_the_worst_steps_through_the_model_and_sampler(tiny_models, monkeypatch):
    """measure_kv_budget drives the real model and sampler through the worst prefill (every
    token of the budget, every sequence sampling, a max_model_len context) and a full padded
    decode, then subtracts both peaks. The CUDA memory queries are faked; the steps are real."""
    from fastgen import LLM
    from fastgen.model_runner import profile_step
    from fastgen.worker.memory_profile import measure_kv_budget
    from fastgen.worker.sampler import Sampler

    llm = LLM(tiny_models["qwen3"], dtype="float32", block_size=16, num_kv_blocks=128, max_num_seqs=8,
              max_num_batched_tokens=256, max_model_len=1024)
    runner = llm.engine.runner
    steps = []

    def recording_step(inputs, seqs, kv_layers):
        steps.append((inputs.input_ids.shape[0], len(seqs), inputs.meta.max_context_len, inputs.meta.is_prefill))
        sampler = Sampler(llm.config.model_config.vocab_size, runner.device, 0, runner.ops.sample_tokens)
        logits = profile_step(runner.model, sampler, inputs, seqs, kv_layers)
        peaks.append(peaks[-1] + 100)  # each step's peak, as max_memory_allocated will report it
        return logits

    peaks = [0]
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: peaks[-1])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (6 * gib, 8 * gib))  # 2 GiB in use
    budget = measure_kv_budget(llm.config, recording_step, graph_batch_size=8,
                               prepare_meta=runner.backend.prepare)
    assert steps == [(256, 8, 1024, True), (8, 8, 0, False)]
    assert budget == int(8 * gib * llm.config.gpu_memory_utilization) - 2 * gib - 100 - 200

    # With speculative decoding, a verify step too: 8 sequences x (1 + 4) sampled rows, the first
    # drafting up to the max_model_len context; the larger of its peak and the prefill's counts.
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    spec_llm = LLM(tiny_models["qwen3"], dtype="float32", block_size=16, num_kv_blocks=128, max_num_seqs=8,
                   max_num_batched_tokens=256, max_model_len=1024, speculative_config=spec)
    llm, runner = spec_llm, spec_llm.engine.runner
    steps.clear()
    peaks[:] = [0]
    budget = measure_kv_budget(llm.config, recording_step, graph_batch_size=8,
                               prepare_meta=runner.backend.prepare)
    assert steps == [(256, 8, 1024, True), (40, 40, 1024, True), (8, 8, 0, False)]
    assert budget == int(8 * gib * llm.config.gpu_memory_utilization) - 2 * gib - 200 - 300
