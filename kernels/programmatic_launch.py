"""Programmatic dependent launch (PDL, Hopper and later): a kernel may start before the one in
front of it has finished, and waits for it only where it must.

A decode step of a small model is hundreds of short kernels in a row; each one's start-up and
its predecessor's tail cost about as much as its work (a product of a few megabytes takes a few
microseconds). Launched as a programmatic dependent, a kernel's programs are placed as soon as
every program of the kernel before has started (that kernel says so with
`gdc_launch_dependents`), issue what does not depend on it (the weight tiles of a product,
which no step writes), then `gdc_wait` until that kernel has finished and its writes are
visible. CUDA graphs keep these edges when they capture the launches.

The rule every kernel launched this way keeps: nothing written by an earlier kernel of the
step is read, and nothing an earlier kernel may still read is written, before `gdc_wait`.
Only the model's weights (written at load time, never by the kernel right before) are read
ahead of it.
"""

from __future__ import annotations

import functools

import torch
import triton

try:  # Triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    GRID_DEPENDENCY_CONTROL = True
except ImportError:  # an older Triton (torch < 2.8 brings one): the kernels launch as before
    GRID_DEPENDENCY_CONTROL = False

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass

# A switch so that benchmarks can compare launches with and without it
# (`benchmarks/gpu_decode.py --programmatic-launch off`).
PROGRAMMATIC_LAUNCH_ON_CUDA = True


@functools.lru_cache(maxsize=None)
def _is_hopper_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents: CUDA devices of compute
    capability 9.0 or later, with a Triton that has grid dependency control (the interpreter on
    a CPU never does)."""
    if not (PROGRAMMATIC_LAUNCH_ON_CUDA and GRID_DEPENDENCY_CONTROL and device.type == "cuda"):
        return False
    return _is_hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(pdl: bool) -> dict:
    """The launch keyword for a programmatic dependent (none otherwise, for older Tritons)."""
    return {"launch_pdl": True} if pdl else {}
