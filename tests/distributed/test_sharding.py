"""How dimensions split across ranks, and the sizes EngineConfig refuses (ValueError naming
tensor_parallel_size, its value and the dimension it cannot split)."""

from __future__ import annotations

import pytest
import torch

from fastgen.config import EngineConfig
from fastgen.models.checkpoint_tensor import CheckpointTensor
from fastgen.parallel.sharding import (
    OutputShard,
    even_shard,
    kv_head_shard,
    vocab_rows_per_rank,
)


def test_even_shard_gives_each_rank_its_block():
    assert [even_shard(12, r, 3) for r in range(3)] == [OutputShard(12, 0, 4), OutputShard(12, 4, 4),
                                                        OutputShard(12, 8, 4)]


def test_kv_heads_split_when_there_are_enough():
    # 4 KV heads of dim 8 over 2 ranks: two heads each.
    assert [kv_head_shard(4, 8, r, 2) for r in range(2)] == [OutputShard(32, 0, 16), OutputShard(32, 16, 16)]


def test_kv_heads_replicated_on_the_ranks_whose_query_heads_read_them():
    # 2 KV heads over 4 ranks: ranks 0-1 hold head 0, ranks 2-3 head 1 (query heads 0-1 | 2-3 |
    # 4-5 | 6-7 of 8 read KV head 0 for the first four, 1 for the last four).
    assert [kv_head_shard(2, 8, r, 4).start // 8 for r in range(4)] == [0, 0, 1, 1]
    assert all(kv_head_shard(2, 8, r, 4).size == 8 for r in range(4))
    # One KV head (multi-query attention) is on every rank.
    assert {kv_head_shard(1, 8, r, 4).start for r in range(4)} == {0}


def test_vocabulary_rows_round_up():
    assert vocab_rows_per_rank(384, 2) == 192
    assert vocab_rows_per_rank(385, 2) == 193
    assert vocab_rows_per_rank(50257, 4) == 12565


@pytest.mark.parametrize("size, message", [
    (3, r"tensor_parallel_size=3 must divide the model's 4 attention heads"),
    (8, r"tensor_parallel_size=8 must divide the model's 4 attention heads"),
])
def test_sizes_that_do_not_split_the_heads_are_refused(tiny_models, size, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=tiny_models["qwen3"], tensor_parallel_size=size)


def test_kv_heads_that_do_not_split_are_refused(tmp_path):
    from tests.tiny_models import build_tiny_model

    model = build_tiny_model("llama", tmp_path / "m", num_attention_heads=6, num_key_value_heads=3, hidden_size=48, head_dim=8)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the model's 3 KV heads"):
        EngineConfig(model=str(model), tensor_parallel_size=2)


def test_mlp_width_that_does_not_split_is_refused(tmp_path):
    from tests.tiny_models import build_tiny_model

    model = build_tiny_model("qwen3", tmp_path / "m", intermediate_size=130)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide .* intermediate_size=130"):
        EngineConfig(model=str(model), tensor_parallel_size=4)


def test_more_ranks_than_cuda_devices_are_refused(tiny_models, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 from device='cuda:1' needs CUDA devices 1..2, "
                                         r"but this machine has 2"):
        EngineConfig(model=tiny_models["qwen3"], device="cuda:1", tensor_parallel_size=2)
    EngineConfig(model=tiny_models["qwen3"], device="cuda:0", tensor_parallel_size=2)  # devices 0 and 1


def test_on_cpu_any_size_that_splits_the_model_is_accepted(tiny_models):
    config = EngineConfig(model=tiny_models["qwen3"], device="cpu", tensor_parallel_size=4)
    assert config.num_kv_heads_per_rank == 1  # 2 KV heads over 4 ranks: replicated


def test_torchrun_world_size_must_equal_the_parallel_size(tiny_models, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 but WORLD_SIZE=3"):
        EngineConfig(model=tiny_models["qwen3"], device="cpu", tensor_parallel_size=2)


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_tensor_parallel_size_must_be_a_positive_integer(tiny_models, value):
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={value!r} must be"):
        EngineConfig(model=tiny_models["qwen3"], tensor_parallel_size=value)


def test_checkpoint_tensor_reads_only_its_window_in_model_orientation():
    stored = torch.arange(12.0).view(3, 4)  # stored [in=3, out=4], seen as [4, 3]
    tensor = CheckpointTensor("w", stored, transposed=True)
    assert tensor.shape == (4, 3)
    rows = tensor.narrow(0, 1, 2)
    assert rows.shape == (2, 3) and torch.equal(rows.read(), stored.t()[1:3])
    assert torch.equal(rows.narrow(1, 2, 1).read(), stored.t()[1:3, 2:3])
    with pytest.raises(ValueError, match=r"checkpoint tensor w: \[1, 5\) of dim 0 is outside its 4 entries"):
        tensor.narrow(0, 1, 4)
