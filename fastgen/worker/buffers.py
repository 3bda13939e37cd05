"""A host buffer and its device twin, allocated once and refilled in place every step."""

from __future__ import annotations

import torch


class CpuGpuBuffer:
    """`.cpu`: a host tensor (pinned on CUDA, so uploads can be asynchronous); `.np`: a numpy
    view of it, for cheap writes from Python; `.gpu`: the device tensor of the same shape
    (the host tensor itself on CPU). `copy_to_gpu(n)` uploads the first n rows and returns
    their device view.
    """

    def __init__(self, shape, dtype: torch.dtype, device: torch.device, fill: int = 0):
        on_cuda = device.type == "cuda"
        self.cpu = torch.full(shape, fill, dtype=dtype, pin_memory=on_cuda)
        self.np = self.cpu.numpy()
        self.gpu = torch.full(shape, fill, dtype=dtype, device=device) if on_cuda else self.cpu

    def copy_to_gpu(self, n: int) -> torch.Tensor:
        if self.gpu is not self.cpu:
            self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]


class TokenReadback:
    """Sampled token ids on their way from the device to the host.

    `start(tokens)` queues a copy into pinned host memory behind the step's work and records an
    event; `wait(n)` blocks on that event only (not the whole device) and returns the ids. In
    between, the host is free to do other work while the GPU finishes the step. One step at a
    time: every `start` is followed by its `wait`. On CPU the copy is immediate.
    """

    def __init__(self, max_tokens: int, device: torch.device):
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(max_tokens, dtype=torch.int64, pin_memory=on_cuda)
        self.event = torch.cuda.Event() if on_cuda else None
        self.pending = 0

    def start(self, tokens: torch.Tensor) -> None:
        assert self.pending == 0, "the previous step's tokens were never read"
        self.pending = tokens.shape[0]
        self.host[: self.pending].copy_(tokens, non_blocking=True)
        if self.event is not None:
            self.event.record()

    def discard(self) -> None:
        """Forget a started copy whose step failed (nothing will read it)."""
        if self.pending and self.event is not None:
            self.event.synchronize()
        self.pending = 0

    def wait(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        n, self.pending = self.pending, 0
        return self.host[:n].tolist()
