"""The sharded model, with ranks as threads (tests/distributed/thread_ranks.py): greedy output
equals transformers token for token for every family and rank count, replicated KV heads,
prefix-cache hits, preemption and chunked prefill included; each rank reads only its shard."""

from __future__ import annotations

import pytest
import torch

from fastgen import SamplingParams
from fastgen.models import checkpoint_tensor
from fastgen.models.build import skip_weight_init
from fastgen.models.loader import load_weights
from fastgen.models.registry import model_class
from tests.conftest import FAMILIES, random_prompts
from tests.distributed.thread_ranks import ThreadCollectives, llm_on_thread_ranks

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", [2, 4])  # 4 ranks over 2 KV heads: each KV head on two ranks
def test_sharded_greedy_equals_transformers(tiny_models, reference, family, size):
    model = tiny_models[family]
    prompts = random_prompts([1, 9, 40, 70], seed=size)
    llm = llm_on_thread_ranks(model, size, block_size=8, max_model_len=128, num_kv_blocks=64,
                              max_num_batched_tokens=48)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference(model, prompts, MAX_TOKENS)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_sharded_prefix_hits_and_preemption_equal_transformers(tiny_models, reference, family):
    model = tiny_models[family]
    system = random_prompts([16], seed=31)[0]
    prompts = random_prompts([4, 19, 34, 10, 26], seed=32, prefix=system)
    # Room for about two sequences at once: the others are preempted and recomputed, mostly
    # from the prefix cache.
    llm = llm_on_thread_ranks(model, 2, block_size=8, max_model_len=72, num_kv_blocks=11, max_num_seqs=5)
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_hit_tokens > 0
    assert [o.token_ids for o in outputs] == reference(model, prompts, MAX_TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_reads_only_its_shard_of_the_checkpoint(tiny_models, monkeypatch, family):
    """Every element a rank reads from the checkpoint lands in one of its parameters: no rank
    reads a whole sharded weight (the safetensors slices are narrowed before reading)."""
    from fastgen.attention import select_backend
    from fastgen.compile import build_op_set
    from fastgen.models.config import ModelConfig

    reads: list[int] = []
    original = checkpoint_tensor.CheckpointTensor.read
    monkeypatch.setattr(checkpoint_tensor.CheckpointTensor, "read",
                        lambda self: reads.append(self.read_numel()) or original(self))
    mc = ModelConfig.from_folder(tiny_models[family])
    ops = build_op_set(False)
    collectives = ThreadCollectives(2)
    for rank in range(2):
        reads.clear()
        with skip_weight_init(True):
            model = model_class(mc.architecture)(mc, select_backend(torch.device("cpu"), 16, ops), ops,
                                                 max_positions=64, tp=collectives.rank(rank))
        load_weights(model, tiny_models[family])
        held = sum(p.numel() for p in model.parameters())
        assert sum(reads) == held, f"rank {rank} read {sum(reads)} elements for {held} parameters"
