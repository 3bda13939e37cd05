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
runs torch's CPU work beside it. `DrivingThreads` is the same hand-back for an `LLM` driven from
whatever thread the application calls it in.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
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


class DrivingThreads:
    """Which threads run one engine's CPU work, so that one thread's workers live at a time.

    The thread that builds the engine (made here) hands its workers back at once, and keeps
    those of its own later drives: single-thread use pays nothing. Any other thread hands its
    own back when a drive ends (`after_drive`), so an application may call from a thread pool.
    What no hand-back can mend: another thread driving after the building thread did, beside
    the building thread's workers again; `before_drive` warns of it once (CPU engines only).
    """

    def __init__(self, cpu: bool):
        self._cpu = cpu
        self._home = threading.current_thread()
        self._home_drove = False
        self._warned = False
        release_openmp_threads()

    def before_drive(self) -> None:
        if threading.current_thread() is self._home:
            self._home_drove = True
        elif self._home_drove and self._cpu and not self._warned:
            self._warned = True
            logger.warning(
                "this LLM runs in thread %r after running in thread %r, which built it: torch's OpenMP runtime "
                "keeps worker threads for both, and CPU steps then run several times slower. Run it from one "
                "thread, or start LLM.background() or AsyncLLM in the thread that built it (which hands that "
                "thread's workers back) and submit from any", threading.current_thread().name, self._home.name)

    def after_drive(self) -> None:
        if threading.current_thread() is not self._home:
            release_openmp_threads()

    def handed_back(self) -> None:
        """The calling thread's workers went (a background loop it started released them)."""
        if threading.current_thread() is self._home:
            self._home_drove = False
