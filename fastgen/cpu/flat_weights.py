"""A model's weights laid out in one buffer per dtype, so a compiled step takes them as few inputs.

A saved compiled step (`fastgen.cpu.saved_graphs`) is called through Dynamo's Python
prologue, which fetches every tensor the graph reads, weight by weight through the module tree,
and hands each to the compiled code, which turns each into a handle: about 1 us a tensor. For
SmolLM2-135M's 182 weight tensors that was about 0.3 ms of a 7-8 ms batch-1 step, the part of
the step that is neither the model nor the engine.

Here every parameter becomes a view of one flat buffer of its dtype (`flatten_weights`), and a
compiled step takes those buffers and forms each weight inside the graph (`weight_views`: a view
at a constant offset, which the compiled code reads in place, no copy), then runs the model on
them through `torch.func.functional_call`. Only the model's buffers (few: RoPE's tables) are
still fetched one by one. Measured on SmolLM2-135M, bf16, 2 threads: Dynamo's prologue went
from 0.36 to 0.12 ms a step, and turning the inputs into handles from 0.085 to 0.02 ms.

On Linux a host buffer is also asked for transparent huge pages (`madvise`, which the kernel
honours where THP is `always` or `madvise`): a batch-1 step streams every weight once, and with
4 KiB pages the hardware prefetchers stop at every page boundary. A 256 MiB row sum over such a
buffer ran at 39.3 GB/s against 36.8 GB/s over 4 KiB pages (same process, alternating).
"""

from __future__ import annotations

import math
import mmap
import sys
from dataclasses import dataclass

import torch
from torch import nn

# Each weight starts 128 bytes (a multiple of) from its buffer's start, which is huge-page aligned
# on Linux: cache-line (and AVX-512 vector) aligned, as a weight of its own allocation would be.
ALIGN_BYTES = 128

HUGE_PAGE_BYTES = 2 << 20


@dataclass(frozen=True)
class FlatWeights:
    """buffers: one flat tensor per dtype, every parameter a view of one of them; slots: per
    parameter, (name, buffer index, offset in elements, shape): plain tuples, so that a traced
    function closing over them sees constants."""

    buffers: tuple[torch.Tensor, ...]
    slots: tuple[tuple[str, int, int, tuple[int, ...]], ...]


def flatten_weights(module: nn.Module) -> FlatWeights:
    """Move every parameter of `module` into one flat buffer of its dtype and device (tied
    parameters once); each parameter object stays and becomes a view of its buffer. The
    parameters' old storages are freed one by one as they are copied, so memory grows by the
    alignment padding only."""
    params = list(module.named_parameters())  # tied parameters appear once
    kinds: list[tuple[torch.dtype, torch.device]] = []
    for _, p in params:
        if (p.dtype, p.device) not in kinds:
            kinds.append((p.dtype, p.device))
    places: list[tuple[int, int]] = []  # per parameter: (buffer index, offset)
    sizes = [0] * len(kinds)
    for _, p in params:
        kind = kinds.index((p.dtype, p.device))
        align = max(1, ALIGN_BYTES // p.element_size())
        places.append((kind, sizes[kind]))
        sizes[kind] += math.ceil(p.numel() / align) * align
    buffers = tuple(_empty_buffer(size, dtype, device) for size, (dtype, device) in zip(sizes, kinds))
    slots = []
    with torch.no_grad():
        for (name, p), (kind, offset) in zip(params, places):
            view = buffers[kind][offset : offset + p.numel()].view(p.shape)
            view.copy_(p)
            p.data = view
            slots.append((name, kind, offset, tuple(p.shape)))
    return FlatWeights(buffers, tuple(slots))


def weight_views(buffers: tuple[torch.Tensor, ...] | list[torch.Tensor],
                 slots: tuple[tuple[str, int, int, tuple[int, ...]], ...]) -> dict[str, torch.Tensor]:
    """Each parameter's tensor by name, as views of `buffers` (what `functional_call` takes)."""
    return {name: buffers[kind][offset : offset + math.prod(shape)].view(shape)
            for name, kind, offset, shape in slots}


def _empty_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised flat tensor; on a Linux host, in memory advised for huge pages."""
    linux_host = device.type == "cpu" and sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
    if numel == 0 or not linux_host:
        return torch.empty(numel, dtype=dtype, device=device)
    nbytes = numel * dtype.itemsize
    # Anonymous memory, started at a huge-page boundary inside a mapping one huge page longer.
    # The tensor keeps the mapping alive (torch.frombuffer holds the buffer).
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without THP: 4 KiB pages, as torch.empty would give
        pass
    address = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    skip = -address % HUGE_PAGE_BYTES
    return torch.frombuffer(region, dtype=dtype, count=numel, offset=skip)
