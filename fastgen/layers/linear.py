"""A linear layer whose weight is several checkpoint weights stacked along the output dim."""

from __future__ import annotations

from torch import nn


class MergedLinear(nn.Linear):
    """One matmul for several projections of the same input (q|k|v, gate|up).

    shard_sizes: output rows of each stacked projection, in order.
    """

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = list(shard_sizes)

    def shard_offset(self, index: int) -> int:
        return sum(self.shard_sizes[:index])
