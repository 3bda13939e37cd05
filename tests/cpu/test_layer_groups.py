"""A step compiled a group of layers at a time (`fastgen.cpu.layer_groups`): how the layers are
cut, the weights each group's graph reads, and outputs equal to transformers where one compiled
group runs every group of a deeper model, and where layers that differ make one group."""

from __future__ import annotations

import pytest
import torch

from fastgen import LLM, SamplingParams
from fastgen.cpu.flat_weights import flatten_weights, weight_views
from fastgen.cpu.layer_groups import MAX_GROUPS, group_weights, layers_per_group
from tests.conftest import random_prompts
from tests.tiny_models import build_tiny_model, hf_greedy


def test_layers_are_cut_into_a_few_equal_groups():
    # The largest divisor no more than a third: 30 layers as 3 x 10, 28 as 4 x 7, 24 as 3 x 8.
    assert [layers_per_group(n, True) for n in (30, 28, 24, 32, 36, 2, 1, 3)] == [10, 7, 8, 8, 12, 1, 1, 1]
    # More than MAX_GROUPS calls a step (a prime count, 22 = 11 x 2): the layers in one group.
    assert MAX_GROUPS == 6 and [layers_per_group(n, True) for n in (22, 13, 7)] == [22, 13, 7]
    assert layers_per_group(30, False) == 30  # layers that run different code: one group


class Stack(torch.nn.Module):
    def __init__(self, widths: list[int]):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, w, bias=False) for w in widths)
        self.norm = torch.nn.LayerNorm(4)


def test_each_group_reads_its_own_layers_weights_at_one_layout():
    model = Stack([4] * 6)
    flat = flatten_weights(model)
    grouped = group_weights(flat, "layers", 6, 2)
    assert grouped is not None and len(grouped.groups) == 3
    assert {tuple(t.shape) for group in grouped.groups for t in group} == {tuple(grouped.groups[0][0].shape)}
    assert {name for name, *_ in grouped.head_slots} == {"embed.weight", "norm.weight", "norm.bias"}
    for index, group in enumerate(grouped.groups):
        views = weight_views(group, grouped.layout)
        for i in range(2):
            weight = views[f"layers.{i}.weight"]
            assert weight.data_ptr() == model.layers[2 * index + i].weight.data_ptr()  # read in place
            assert torch.equal(weight, model.layers[2 * index + i].weight)


def test_layers_whose_weights_differ_are_not_grouped():
    model = Stack([4, 4, 4, 8])  # the last layer's weight is larger: no one layout fits every group
    assert group_weights(flatten_weights(model), "layers", 4, 2) is None


def compiled_llm(model: str) -> LLM:
    return LLM(model, enforce_eager=False, compile_mode="blocking", compile_processes=1, dtype="float32",
               block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)


def test_one_compiled_group_runs_every_group_of_a_deeper_model(tmp_path, private_cache):
    """Six layers as three groups of two: one graph of two layers runs all three, each on its
    group's weights and caches; a ragged, chunked batch and a lone request equal transformers."""
    model = str(build_tiny_model("qwen3", tmp_path / "deep", num_hidden_layers=6,
                                 layer_types=["full_attention"] * 6))
    llm = compiled_llm(model)
    compiled = llm.engine.runner.compiled_decode
    assert compiled.grouped.size == 2 and len(compiled.grouped.groups) == 3
    prompts = random_prompts([11], seed=5) + random_prompts([3, 30, 70, 6], seed=6)
    max_tokens = 9
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    alone = llm.generate(prompts[:1], params)[0].outputs[0].token_ids
    batch = [out.outputs[0].token_ids for out in llm.generate(prompts[1:], params)]
    assert [alone, *batch] == hf_greedy(model, prompts, max_tokens)
    assert set(compiled.first_call_seconds) == {"layers", "head"} and not compiled.failed


@pytest.mark.slow  # a compile of its own for a rare config; grouping is tested in the fast suite above
def test_layers_scaled_by_their_index_compile_as_one_group(tmp_path, private_cache):
    """GPT-2 with scale_attn_by_inverse_layer_idx: each layer's scale is its own constant, so no
    one compiled layer serves another; all three run in one group, still equal to transformers."""
    model = str(build_tiny_model("gpt2", tmp_path / "scaled", n_layer=3, scale_attn_by_inverse_layer_idx=True))
    llm = compiled_llm(model)
    compiled = llm.engine.runner.compiled_decode
    assert compiled.grouped.size == 3 and len(compiled.grouped.groups) == 1
    prompts = random_prompts([7, 20], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert outputs == hf_greedy(model, prompts, 8)
