"""The decode graph runner's pad-copy-slice path, run eagerly on CPU (capture=False) over the
same persistent buffers a CUDA graph reads; and, on a GPU, real capture and replay."""

from __future__ import annotations

import pytest
import torch

from fastgen import LLM, SamplingParams
from fastgen.graphs import CudaGraphRunner, default_capture_sizes, padded_size
from fastgen.sequence import FinishReason
from tests.conftest import random_prompts


def test_default_capture_sizes():
    assert default_capture_sizes(256, 512)[:6] == [1, 2, 4, 8, 16, 24]
    assert default_capture_sizes(256, 512)[-3:] == [224, 240, 256]
    assert default_capture_sizes(100, 512)[-2:] == [96, 100]
    assert default_capture_sizes(1024, 512)[-1] == 512
    assert default_capture_sizes(3, 512) == [1, 2, 3]


def test_padded_size():
    sizes = [1, 2, 4, 8]
    assert [padded_size(n, sizes) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


def llm_with_emulated_graphs(model, sizes, **kwargs) -> LLM:
    llm = LLM(model, dtype="float32", **kwargs)
    runner = llm.engine.runner
    runner.graphs = CudaGraphRunner(runner.model, runner.inputs, runner.kv_cache.layers, sizes,
                                    llm.config.max_model_len, runner.device, capture=False)
    return llm


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # RoPE / learned positions from the padded buffers
@pytest.mark.parametrize("sizes", [[1, 2, 4, 8], [3, 5]])
def test_padded_decode_matches_transformers(tiny_models, reference, sizes, family):
    model = tiny_models[family]
    prompts = random_prompts([3, 9, 17, 30, 41, 5, 12], seed=4)
    llm = llm_with_emulated_graphs(model, sizes, block_size=4, num_kv_blocks=256, max_num_seqs=8)
    # Different lengths finish at different steps, so the batch shrinks through the sizes.
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 20, 7, 12, 1, 16, 9)]
    outputs = llm.generate(prompts, params)
    expected = reference(model, prompts, 20)
    for out, want, p in zip(outputs, expected, params):
        assert out.token_ids == want[: p.max_tokens]


def cache_blocks(runner, blocks) -> torch.Tensor:
    """Every layer's K and V rows of `blocks`, stacked: [layers * 2, len(blocks), ...]."""
    index = torch.tensor(blocks, device=runner.device)
    return torch.stack([cache.index_select(0, index) for layer in runner.kv_cache.layers for cache in layer])


def _decode_batch(llm, prompts, steps_before=1):
    """Admit prompts, prefill them, and return the next decode SchedulerOutput (not yet run)."""
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(steps_before):
        engine.step()
    out = engine.scheduler.schedule()
    assert out is not None and not out.is_prefill
    return out


def test_padding_rows_carry_nothing_stale(tiny_models):
    model = tiny_models["qwen3"]
    llm = llm_with_emulated_graphs(model, [2, 8], block_size=4, num_kv_blocks=128, max_num_seqs=8, max_model_len=128)
    runner = llm.engine.runner
    # A first, larger batch leaves its ids, positions and block tables in the buffers.
    big = _decode_batch(llm, random_prompts([20, 21, 22, 23, 24, 25], seed=1))
    runner.graphs.run(big)
    for seq in big.seqs:
        llm.engine.scheduler.finish(seq, FinishReason.ABORT)
    small = _decode_batch(llm, random_prompts([6, 11, 7], seed=2))
    inputs, logits, greedy = runner.graphs.run(small)
    n = len(small.seqs)
    assert logits.shape[0] == n and greedy.shape == (n,) and inputs.num_rows == n
    assert torch.equal(greedy, logits.argmax(-1)), "the graph's greedy ids are its logits' argmax"
    size = inputs.input_ids.shape[0]
    assert size == 8
    assert inputs.meta.slot_mapping[n:].eq(-1).all()
    assert inputs.meta.context_lens[n:].eq(0).all()
    assert inputs.meta.block_tables[n:].eq(-1).all()
    assert inputs.input_ids[n:].eq(0).all() and inputs.positions[n:].eq(0).all()
    # Real rows: same logits as an unpadded eager run of the same step.
    unpadded = runner.forward_logits(runner.inputs.build_decode(small))
    torch.testing.assert_close(logits, unpadded, rtol=1e-5, atol=1e-5)


def test_padding_rows_never_write_the_cache(tiny_models):
    llm = llm_with_emulated_graphs(tiny_models["qwen2"], [8], block_size=4, num_kv_blocks=64, max_num_seqs=8, max_model_len=128)
    runner = llm.engine.runner
    out = _decode_batch(llm, random_prompts([5, 9], seed=3))
    owned = {b for seq in out.seqs for b in seq.block_table}
    others = [b for b in range(runner.num_kv_blocks) if b not in owned]
    before = cache_blocks(runner, others)
    runner.graphs.run(out)
    assert torch.equal(cache_blocks(runner, others), before)


def test_the_last_replayed_shape_is_known_only_while_its_inputs_are_the_last_uploaded(tiny_models):
    """What a benchmark may replay again by itself: a graph replayed after another step's upload
    reads that step's rows (with packed uploads, another layout's bytes)."""
    llm = llm_with_emulated_graphs(tiny_models["qwen3"], [2, 8], block_size=4, num_kv_blocks=128, max_num_seqs=8,
                                   max_model_len=128)
    runner, engine = llm.engine.runner, llm.engine
    assert runner.graphs.last_replayed_shape() is None
    out = _decode_batch(llm, random_prompts([6, 11, 7], seed=5))
    runner.graphs.run(out)
    assert runner.graphs.last_replayed_shape() == (8, False)
    runner.inputs.build_decode(out)  # any later upload, here the same step unpadded
    assert runner.graphs.last_replayed_shape() is None
    engine.add_request(random_prompts([9], seed=6)[0], SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()  # a prefill (eager) after the replays
    assert runner.graphs.last_replayed_shape() is None


# ---- on a GPU ----------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_graph_replay_equals_eager_token_for_token(tiny_models, family):
    model = tiny_models[family]
    prompts = random_prompts([3, 50, 17, 200, 9, 64, 31, 5, 120, 77], seed=8)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (40, 5, 33, 12, 40, 21, 8, 40, 2, 17)]
    # float32: a random tiny model's logits are nearly flat, and in bf16 a padded GEMM (M rounded
    # up to the graph size) may pick another kernel whose last-bit differences flip a near-tie.
    common = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=512, max_num_seqs=16)
    eager = LLM(model, enforce_eager=True, **common).generate(prompts, params)
    graphs_llm = LLM(model, enforce_eager=False, **common)
    assert graphs_llm.engine.runner.graphs is not None
    graphed = graphs_llm.generate(prompts, params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


@pytest.mark.cuda
def test_graph_padding_rows_never_write_the_cache_on_gpu(tiny_models):
    llm = LLM(tiny_models["qwen3"], device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=64,
              max_num_seqs=8, cuda_graph_batch_sizes=[8], enforce_eager=False)
    runner = llm.engine.runner
    out = _decode_batch(llm, random_prompts([5, 9, 30], seed=3))
    owned = {b for seq in out.seqs for b in seq.block_table}
    others = [b for b in range(runner.num_kv_blocks) if b not in owned]
    checksum = cache_blocks(runner, others).double().sum().item()
    runner.graphs.run(out)
    torch.cuda.synchronize()
    assert cache_blocks(runner, others).double().sum().item() == checksum
