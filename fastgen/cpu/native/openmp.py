"""Hand a thread's OpenMP workers back, so that the engine's loop thread gets the CPUs to itself.

torch's CPU ops, Inductor's compiled kernels and fastgen's C++ kernels split their work with
OpenMP, through GNU OpenMP (libgomp; torch's Linux wheels ship their own copy). libgomp gives
every thread that runs a parallel region a pool of worker threads of its own, kept until that
thread exits, and once the workers of all pools outnumber the CPUs it stops letting them spin
between regions: they sleep, and every region after that pays for waking them. A thread that
ran torch's parallel ops (an application's warm-up `generate`, or any CPU step) holds such a
pool; a background loop thread (`fastgen.engine.background`, behind `AsyncLLM` and `fastgen
serve`) that then runs the steps starts a second one, and every step it runs is slower: on two
cores, SmolLM2-135M's compiled batch-1 decode step took 24 ms in the loop thread against 7 ms in
the thread that had run the model before.

`release_openmp_threads` ends the calling thread's pool, as its exit would, through OpenMP 5.0's
`omp_pause_resource_all`: libgomp frees the pool of the thread that calls it (the standard and
LLVM's runtime pause the whole process; this module acts on libgomp only). Parallel regions the
thread runs later make a new pool, so the loop thread keeps its speed only while no other thread
runs torch's CPU work beside it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)

# OpenMP 5.0's omp_pause_resource_t: a soft pause ends the threads and keeps the runtime's state.
OMP_PAUSE_SOFT = 1


def loaded_libgomps() -> list[str]:
    """The paths of every GNU OpenMP runtime loaded into this process (torch's own copy, and any
    other a library brought), in the order they are mapped; empty off Linux or where none is."""
    if not sys.platform.startswith("linux"):
        return []
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if path.rsplit("/", 1)[-1].startswith("libgomp") and path not in paths:
                    paths.append(path)
    except OSError:
        return []
    return paths


@functools.cache
def _pause_function(path: str) -> Callable[[int], int] | None:
    """`omp_pause_resource_all` of the libgomp at `path`, or None where it has none (older than
    OpenMP 5.0: said once, here)."""
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):
        logger.warning("%s has no omp_pause_resource_all (OpenMP 5.0): its OpenMP workers cannot be handed back, "
                       "and CPU steps in a thread beside another thread's workers may run slower", path)
        return None
    pause.argtypes = (ctypes.c_int,)
    pause.restype = ctypes.c_int
    return pause


def release_openmp_threads() -> bool:
    """End the OpenMP worker threads the calling thread has started, in every libgomp loaded
    (read again each call: a compiled step or kernel library may bring one later). Returns
    whether it did: False without libgomp, with one older than OpenMP 5.0, or when a runtime
    refused (the caller is inside a parallel region). Call it from the thread whose workers
    should go, outside any parallel region."""
    functions = [_pause_function(path) for path in loaded_libgomps()]
    if not functions:
        return False
    refused = [pause for pause in functions if pause is not None and pause(OMP_PAUSE_SOFT) != 0]
    if refused:
        logger.warning("could not end this thread's OpenMP workers (called inside a parallel region?); CPU steps "
                       "in another thread may run slower")
    return not refused and None not in functions
