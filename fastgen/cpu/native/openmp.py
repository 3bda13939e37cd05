"""Hand a thread's OpenMP workers back, so that the engine's loop thread gets the CPUs to itself.

torch's CPU ops, Inductor's compiled kernels and fastgen's C++ kernels all split their work with
OpenMP, through the one GNU OpenMP runtime (libgomp) that torch's wheel ships. libgomp gives
every thread that starts a parallel region a pool of worker threads of its own, kept until that
thread exits, and once the workers of all pools outnumber the CPUs it stops letting them spin
between regions: they sleep, and every region after that pays for waking them. An engine is
built, loaded and warmed up in the thread that makes the `LLM` (usually the main thread, which
lives as long as the process), so that thread holds a pool; a background loop thread
(`fastgen.engine.background`, behind `AsyncLLM` and `fastgen serve`) that then runs the steps
starts a second one, and every step it runs is that much slower: on two cores, SmolLM2-135M's
compiled batch-1 decode step took 24 ms in the loop thread against 7 ms in the thread that built
the engine.

`release_openmp_threads` ends the calling thread's pool (`omp_pause_resource_all`, OpenMP 5.0),
as its exit would. Parallel regions the thread starts later make a new pool: the loop thread is
fast again only while no other thread runs torch's CPU work beside it.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

# OpenMP 5.0's omp_pause_resource_t: a soft pause ends the threads and keeps the runtime's state.
OMP_PAUSE_SOFT = 1


def loaded_libgomp() -> str | None:
    """The path of the GNU OpenMP runtime loaded into this process (torch's own copy), or None
    (another OS, another runtime, or none loaded)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if path.rsplit("/", 1)[-1].startswith("libgomp"):
                    return path
    except OSError:
        return None
    return None


def release_openmp_threads() -> bool:
    """End the OpenMP worker threads the calling thread has started. Returns whether it did:
    False without libgomp, with one older than OpenMP 5.0, or when the runtime refused (inside a
    parallel region). Call it from the thread whose workers should go, outside any region."""
    path = loaded_libgomp()
    if path is None:
        return False
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes = (ctypes.c_int,)
    pause.restype = ctypes.c_int
    released = pause(OMP_PAUSE_SOFT) == 0
    if not released:
        logger.warning("could not end this thread's OpenMP workers; CPU steps in another thread may run slower")
    return released
