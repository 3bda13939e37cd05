"""The token embedding and the LM head split along the vocabulary across tensor-parallel ranks.

Rank r holds rows [r * rows, (r + 1) * rows) of the [vocab, hidden] matrix, rows =
ceil(vocab / size); rows past the vocabulary (on the last ranks) are padding, zero-filled. The
embedding looks up the ids that fall in its rows, writes zeros for the others, and one
all-reduce assembles every token's vector. The LM head computes the logits of its rows and the
ranks' pieces are gathered and cut back to the vocabulary. With one rank both are the plain
layers. A tied LM head shares the embedding's (sharded) weight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from fastgen.layers.parallel_linear import check_shape, copy_into
from fastgen.layers.quantizable import QuantizableWeight
from fastgen.parallel.group import TensorParallelGroup
from fastgen.parallel.sharding import vocab_rows_per_rank

if TYPE_CHECKING:
    from fastgen.models.checkpoint_tensor import CheckpointTensor


def load_vocab_rows(weight: torch.Tensor, tensor: CheckpointTensor, vocab_size: int, tp: TensorParallelGroup) -> None:
    """Fill this rank's rows of a [vocab, hidden] checkpoint matrix; padding rows get zeros."""
    check_shape(tensor, (vocab_size, weight.shape[1]))
    rows = weight.shape[0]
    start = tp.rank * rows
    real = max(0, min(rows, vocab_size - start))
    copy_into(weight[:real], tensor.narrow(0, start, real))
    with torch.no_grad():
        weight[real:].zero_()


class VocabParallelEmbedding(QuantizableWeight, nn.Embedding):
    """ids [T] (int64, anywhere in the vocabulary) -> [T, hidden] on every rank."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup):
        super().__init__(vocab_rows_per_rank(vocab_size, tp.size), hidden_size)
        self.vocab_size = vocab_size
        self.tp = tp
        self.first_row = tp.rank * self.num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(ids)
        local = ids - self.first_row
        outside = (local < 0) | (local >= self.num_embeddings)
        out = self.lookup(local.masked_fill(outside, 0))
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))

    def load_checkpoint_tensor(self, suffix: str, tensor: CheckpointTensor, index: int | None) -> list[str]:
        load_vocab_rows(self.weight, tensor, self.vocab_size, self.tp)
        return [suffix]


class ParallelLMHead(QuantizableWeight, nn.Linear):
    """hidden [S, hidden] -> logits [S, vocab] in the weight's dtype, on every rank."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallelGroup):
        super().__init__(hidden_size, vocab_rows_per_rank(vocab_size, tp.size), bias=False)
        self.vocab_size = vocab_size
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.gather_last_dim(self.product(hidden, None))
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]

    def load_checkpoint_tensor(self, suffix: str, tensor: CheckpointTensor, index: int | None) -> list[str]:
        load_vocab_rows(self.weight, tensor, self.vocab_size, self.tp)
        return [suffix]
