"""Linear layers split across tensor-parallel ranks (Megatron-style), each loading only its shard.

A decoder layer pairs them so that it communicates once per block: a column-parallel projection
(q|k|v, gate|up: each rank computes its slice of the outputs from the whole input, no
communication) feeds attention or the activation on local heads / columns, and a row-parallel
projection (o_proj, down_proj: each rank multiplies its slice of the inputs) ends in one
all-reduce that sums the partial outputs. With one rank both are plain nn.Linear.

Checkpoint loading: `load_checkpoint_tensor(suffix, tensor, index)` receives a lazily read
`CheckpointTensor` and narrows it to this rank's rows / columns before reading.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from fastgen.layers.quantizable import QuantizableWeight
from fastgen.parallel.group import TensorParallelGroup
from fastgen.parallel.sharding import OutputShard

if TYPE_CHECKING:
    from fastgen.models.checkpoint_tensor import CheckpointTensor


def check_shape(tensor: CheckpointTensor, expected: tuple[int, ...]) -> None:
    if tensor.shape != tuple(expected):
        raise ValueError(f"checkpoint tensor {tensor.name} has shape {tensor.shape}, model expects {tuple(expected)}")


def copy_into(target: torch.Tensor, tensor: CheckpointTensor) -> None:
    """Read `tensor`'s window into `target` (the caller checked the shapes)."""
    with torch.no_grad():
        target.copy_(tensor.read())


class ColumnParallelLinear(QuantizableWeight, nn.Linear):
    """One matmul for this rank's slice of one or more projections of the same input.

    shards: per projection (q, k, v; or gate, up), the output rows this rank holds, in order; the
    output is those slices end to end: [T, sum(shard.size)]. One projection over one rank is a
    plain nn.Linear; several are the merged q|k|v or gate|up matmul.
    Checkpoint keys: "weight" / "bias" for one projection, "weight#i" / "bias#i" for several.
    """

    def __init__(self, in_features: int, shards: list[OutputShard], bias: bool):
        super().__init__(in_features, sum(s.size for s in shards), bias=bias)
        self.shards = list(shards)

    @property
    def merged(self) -> bool:
        return len(self.shards) > 1

    def local_offset(self, index: int) -> int:
        """Where projection `index`'s rows start in this rank's output."""
        return sum(s.size for s in self.shards[:index])

    def load_checkpoint_tensor(self, suffix: str, tensor: CheckpointTensor, index: int | None) -> list[str]:
        """index: which projection the checkpoint tensor holds; None when it holds all of them
        stacked (GPT-2's c_attn). Returns the keys it filled."""
        param = getattr(self, suffix)
        tail = tuple(param.shape[1:])
        if index is None:
            check_shape(tensor, (sum(s.full for s in self.shards), *tail))
            starts = [sum(s.full for s in self.shards[:i]) for i in range(len(self.shards))]
            pieces = [(i, tensor.narrow(0, start, s.full)) for i, (s, start) in enumerate(zip(self.shards, starts))]
        else:
            check_shape(tensor, (self.shards[index].full, *tail))
            pieces = [(index, tensor)]
        for i, source in pieces:
            shard = self.shards[i]
            copy_into(param.narrow(0, self.local_offset(i), shard.size), source.narrow(0, shard.start, shard.size))
        return [f"{suffix}#{i}" if self.merged else suffix for i, _ in pieces]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)


class RowParallelLinear(QuantizableWeight, nn.Linear):
    """y = x W^T + b where x arrives split along its features (the column-parallel layer's local
    output): each rank multiplies its [out, in / size] slice, one all-reduce sums the partial
    products, and the bias is added once, after it. Returns the whole [T, out] on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup):
        super().__init__(in_features // tp.size, out_features, bias=bias)
        self.tp = tp
        self.full_in_features = in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.product(x, self.bias)
        out = self.tp.all_reduce(self.product(x, None))
        return out if self.bias is None else out.add_(self.bias)

    def load_checkpoint_tensor(self, suffix: str, tensor: CheckpointTensor, index: int | None) -> list[str]:
        if suffix == "bias":
            check_shape(tensor, (self.out_features,))
            copy_into(self.bias, tensor)
        else:
            check_shape(tensor, (self.out_features, self.full_in_features))
            copy_into(self.weight, tensor.narrow(1, self.tp.rank * self.in_features, self.in_features))
        return [suffix]
