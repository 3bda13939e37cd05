"""Verify steps laid out as decode rows (`StepInputBuilder.fill_verify`), the layout the CUDA
verify graphs replay, run here through the graph runner's pad-copy-slice path without capture:
greedy tokens equal transformers', with drafts kept and rejected beside plain decode steps."""

from __future__ import annotations

import pytest

from fastgen import LLM, SamplingParams
from fastgen.graphs import CudaGraphRunner
from fastgen.graphs.runner import verify_sizes
from fastgen.worker.buffers import CpuGpuBuffer
from fastgen.worker.step_inputs import StepInputBuilder
from tests.conftest import random_prompts
from tests.speculative.test_speculative_engine import MAX_TOKENS, NGRAM, corrupted, greedy


def test_verify_graph_sizes_cover_full_drafts_within_the_largest_decode_graph():
    assert verify_sizes([1, 2, 4, 8], 5, 40) == [2, 4, 5, 8]  # a verify step has two rows at least
    assert verify_sizes([1, 2, 4, 8, 16], 5, 20) == [2, 4, 5, 8, 10, 16]
    assert verify_sizes([1, 2, 4, 8, 16], 5, 6) == [2, 4, 5]  # the builder's rows bound it too
    assert verify_sizes([1, 2, 4], 5, 20) == [2, 4, 5]  # one sequence's full draft always fits
    assert verify_sizes([1, 2], 1, 8) == [] and verify_sizes([1, 2], 5, 0) == []


# RoPE (q/k-norm) / learned positions; and with the step's inputs packed into one transfer, as on CUDA
@pytest.mark.parametrize("family,packed", [("qwen3", False), ("gpt2", False), ("qwen3", True)])
def test_verify_steps_as_decode_rows_equal_transformers(tiny_models, reference, family, packed, monkeypatch):
    model = tiny_models[family]
    prompts = random_prompts([9, 20, 6], seed=16)
    want = reference(model, prompts, MAX_TOKENS)
    llm = LLM(model, dtype="float32", block_size=8, max_model_len=64, num_kv_blocks=96, max_num_seqs=4,
              speculative_config=NGRAM)
    engine = llm.engine
    runner = engine.runner
    if packed:  # before any step: the builder keeps no sequence's rows yet
        config = llm.config
        runner.inputs = StepInputBuilder(config.max_num_seqs, config.max_num_batched_tokens, config.max_blocks_per_seq,
                                         config.block_size, runner.device, runner.backend.prepare,
                                         NGRAM["num_speculative_tokens"], pack_uploads=True)
        monkeypatch.setattr(CpuGpuBuffer, "copy_to_gpu", lambda self, n: pytest.fail("a buffer copied on its own"))
    runner.graphs = CudaGraphRunner(runner.model, runner.inputs, runner.kv_cache.layers, [1, 2, 4, 8, 16],
                                    llm.config.max_model_len, runner.device, capture=False,
                                    verify_rows_per_seq=1 + NGRAM["num_speculative_tokens"])
    engine.drafter.threshold = lambda batch_size: 0.0  # every draft pays: verify steps all along
    layouts = []
    fill_verify = runner.inputs.fill_verify

    def counted(out, pad_to=None):
        layouts.append(fill_verify(out, pad_to))
        return layouts[-1]

    monkeypatch.setattr(runner.inputs, "fill_verify", counted)
    outs = llm.generate(prompts, [greedy(prediction=want[0]), greedy(prediction=corrupted(want[1])), greedy()])
    assert [o.token_ids for o in outs] == want
    assert outs[0].metrics.num_accepted_draft_tokens > 0
    assert outs[1].metrics.num_draft_tokens > outs[1].metrics.num_accepted_draft_tokens > 0
    assert layouts and all(layout.num_rows in runner.graphs.verify_sizes for layout in layouts)
    assert any(layout.num_rows > layout.num_seqs for layout in layouts)  # several rows a sequence
    engine.check_invariants()


def test_a_verify_step_that_no_graph_fits_is_verified_in_the_prefill_layout(tiny_models, monkeypatch):
    """Four sequences with drafts need more rows than the largest verify graph (5): those steps
    take the prefill layout, eagerly; the tokens are the engine's without speculation."""
    model = tiny_models["llama"]
    prompts = random_prompts([7, 7, 7, 7], seed=3)
    llm = LLM(model, dtype="float32", block_size=8, max_model_len=64, num_kv_blocks=96, max_num_seqs=4,
              speculative_config=NGRAM)
    plain = LLM(model, dtype="float32", block_size=8, max_model_len=64, num_kv_blocks=96, max_num_seqs=4)
    runner = llm.engine.runner
    runner.graphs = CudaGraphRunner(runner.model, runner.inputs, runner.kv_cache.layers, [1, 2], 64, runner.device,
                                    capture=False, verify_rows_per_seq=5)
    assert runner.graphs.verify_sizes == [2, 5]
    llm.engine.drafter.threshold = lambda batch_size: 0.0
    drafted_prefills = []
    fill_prefill = runner.inputs.fill_prefill

    def counted(out):
        if out.draft_tokens:
            drafted_prefills.append(out.num_tokens)
        return fill_prefill(out)

    monkeypatch.setattr(runner.inputs, "fill_prefill", counted)
    want = [o.token_ids for o in plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12,
                                                                         ignore_eos=True))]
    outs = llm.generate(prompts, [greedy(prediction=w, max_tokens=12) for w in want])
    assert [o.token_ids for o in outs] == want
    assert drafted_prefills and min(drafted_prefills) > 5
    llm.engine.check_invariants()
