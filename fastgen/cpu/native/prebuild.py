"""The CPU kernels a CPU engine's steps use, built in a background thread as soon as one is
coming (`fastgen.llm.LLM`, the CLI), so that their compiles (about 5 seconds for the attention
kernel on two cores, 1-2 for each of the others) overlap the model's conversion and loading
instead of holding up the first step. One thread builds them one after another, the attention
kernel first (every CPU engine's first prompt needs it): the compiler then takes one core, and
the conversion keeps the other."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from fastgen.cpu.native.library import build_quietly, torch_abi_flags
from fastgen.paths import cache_dir

# Off in the test suite (its engines each have a cache folder of their own, and a build for one
# would run on into the next test); a test of this module turns it on.
ENABLED = True

_started: dict[Path, threading.Thread] = {}  # cache folder -> the thread building its kernels
_started_lock = threading.Lock()


def engine_runs_on_cpu(device: object) -> bool:
    """Whether an engine asked for `device` (an EngineConfig value; None is its default) will
    run on this machine's CPU."""
    name = str(device) if device is not None else "auto"
    return name == "cpu" or (name == "auto" and not torch.cuda.is_available())


def build_cpu_kernels_in_background(device: object) -> threading.Thread | None:
    """Start building the CPU kernels where the engine will run on the CPU (None otherwise),
    into the cache folder of this moment; once a folder (the CLI asks before converting the
    default model, and `LLM` again as it starts). A library already there costs a digest and
    no compile."""
    if not ENABLED or not engine_runs_on_cpu(device):
        return None
    from fastgen.cpu.native import decode_attention, gemm, packed_linear

    root = cache_dir()
    with _started_lock:
        if root in _started:
            return _started[root]
        libraries = ((decode_attention.SOURCE, ()), (decode_attention.OP_SOURCE, torch_abi_flags()), (gemm.SOURCE, ()),
                     (packed_linear.OP_SOURCE, torch_abi_flags()))

        def build_all() -> None:
            for source, flags in libraries:
                build_quietly(source, flags, root)

        thread = threading.Thread(target=build_all, name="build the CPU kernels", daemon=True)
        thread.start()
        _started[root] = thread
    return thread
