"""Each sharded layer, loaded from a whole checkpoint tensor and run on every rank (ranks as
threads), gives what the unsharded layer gives: biases added once, padded vocabularies cut."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from fastgen.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from fastgen.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from fastgen.models.checkpoint_tensor import CheckpointTensor
from fastgen.parallel.sharding import even_shard, kv_head_shard
from tests.distributed.thread_ranks import ThreadCollectives


def on_every_rank(size: int, fn) -> list:
    """fn(rank_group) on `size` thread ranks; their results in rank order."""
    collectives = ThreadCollectives(size)
    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(lambda r: fn(collectives.rank(r)), range(size)))


def load(layer, **tensors):
    for suffix, (tensor, index) in tensors.items():
        layer.load_checkpoint_tensor(suffix, CheckpointTensor(suffix, tensor), index)
    return layer


@pytest.mark.parametrize("size", [1, 2, 4])
def test_column_then_row_parallel_equals_the_whole_mlp(size):
    torch.manual_seed(0)
    hidden, inner = 8, 16
    up_w, up_b = torch.randn(inner, hidden), torch.randn(inner)
    down_w, down_b = torch.randn(hidden, inner), torch.randn(hidden)
    x = torch.randn(5, hidden)
    expected = F.linear(F.linear(x, up_w, up_b).relu(), down_w, down_b)

    def rank_output(tp):
        up = load(ColumnParallelLinear(hidden, [even_shard(inner, tp.rank, tp.size)], bias=True),
                  weight=(up_w, None), bias=(up_b, None))
        down = load(RowParallelLinear(inner, hidden, bias=True, tp=tp), weight=(down_w, None), bias=(down_b, None))
        return down(up(x).relu())

    for out in on_every_rank(size, rank_output):
        torch.testing.assert_close(out, expected)


def test_merged_qkv_with_replicated_kv_heads_holds_each_ranks_heads():
    torch.manual_seed(0)
    hidden, head_dim, heads, kv_heads, size = 8, 2, 4, 1, 4
    q_w, k_w, v_w = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    x = torch.randn(3, hidden)

    def rank_output(tp):
        kv = kv_head_shard(kv_heads, head_dim, tp.rank, tp.size)
        layer = ColumnParallelLinear(hidden, [even_shard(heads * head_dim, tp.rank, tp.size), kv, kv], bias=False)
        for index, weight in enumerate((q_w, k_w, v_w)):
            load(layer, weight=(weight, index))
        return layer

    for rank, layer in enumerate(on_every_rank(size, rank_output)):
        q, k, v = layer(x).split([head_dim, head_dim, head_dim], dim=-1)
        torch.testing.assert_close(q, F.linear(x, q_w[rank * head_dim : (rank + 1) * head_dim]))
        torch.testing.assert_close(k, F.linear(x, k_w))  # the one KV head, on every rank
        torch.testing.assert_close(v, F.linear(x, v_w))


@pytest.mark.parametrize("size", [2, 4])
def test_vocabulary_parallel_embedding_and_head_with_a_padded_vocabulary(size):
    torch.manual_seed(0)
    vocab, hidden = 11, 6  # 11 rows do not split evenly: the last ranks hold padding rows
    table = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 10, 5, 3, 10, 7])
    states = torch.randn(4, hidden)

    def rank_outputs(tp):
        embed = load(VocabParallelEmbedding(vocab, hidden, tp), weight=(table, None))
        head = ParallelLMHead(hidden, vocab, tp)
        head.weight = embed.weight  # tied, as most small models are
        return embed(ids), head(states)

    for vectors, logits in on_every_rank(size, rank_outputs):
        torch.testing.assert_close(vectors, table[ids])
        assert logits.shape == (4, vocab)
        torch.testing.assert_close(logits, states @ table.t())


def test_a_checkpoint_tensor_of_the_wrong_shape_is_refused():
    layer = RowParallelLinear(8, 4, bias=False, tp=ThreadCollectives(1).rank(0))
    with pytest.raises(ValueError, match=r"checkpoint tensor weight has shape \(4, 6\), model expects \(4, 8\)"):
        load(layer, weight=(torch.zeros(4, 6), None))
