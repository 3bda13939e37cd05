"""A process's place among the tensor-parallel ranks, and the collectives its layers run.

The model receives one `TensorParallelGroup` when it is built and hands it to its sharded layers
(never a global): row-parallel linears and the vocabulary-parallel embedding sum their partial
results over the ranks (`all_reduce`), the LM head concatenates the ranks' vocabulary slices
(`gather_last_dim`). With one rank (`SINGLE_RANK`) both are the identity and no
torch.distributed call is ever made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallelGroup:
    """rank / size: this process's rank and the number of ranks one model is split across.
    group: the torch.distributed process group of the ranks (NCCL on CUDA, gloo on CPU), None
    for the default group."""

    rank: int = 0
    size: int = 1
    group: object | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], the ranks' pieces in rank order, on every
        rank. (Every rank gets it, not only rank 0 where sampling happens: an all-gather is the
        collective NCCL captures in a CUDA graph, and the decode graph holds the LM head.)"""
        if self.size == 1:
            return x
        if x.numel() == 0:  # every rank has the same shape, so all skip the collective together
            return x.new_empty(*x.shape[:-1], self.size * x.shape[-1])
        import torch.distributed as dist

        gathered = x.new_empty(self.size * x.shape[0], *x.shape[1:])
        # all_gather_single is the name from torch 2.13 on; older releases call it _into_tensor.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, x.contiguous(), group=self.group)
        return gathered.view(self.size, *x.shape).movedim(0, -2).flatten(-2)

    def min_across_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (so all ranks agree on, e.g., a KV budget)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE_RANK = TensorParallelGroup()
