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
