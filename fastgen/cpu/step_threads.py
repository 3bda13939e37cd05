"""The thread count of this process's CPU steps while background children compile their graphs
(`fastgen.cpu.background_compile`): one fewer (at least one), so that a child, one core's work,
has a core of its own.

With every core in the steps' OpenMP team, the compiler takes one of their cores for a scheduler
slice at a time, and each parallel region of an eager step (hundreds a step) then waits at its
barrier for the thread that lost its core while the others spin: a first 8-token completion of
the default model took seconds instead of a fraction of one. Compiled graphs have the count
written into them, so an engine runs none until its child has ended.

One `STEP_THREADS` for the process: its engines share the cores and torch's thread count.
`torch.set_num_threads` sets the calling thread's OpenMP count and the default of threads that
have not run parallel work yet, so each engine calls `update` in the thread that runs its step,
before the step. A thread that stepped with a thread fewer and steps again after the last child
ended gets its count back then (`settle`).
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from contextlib import contextmanager

import torch


class StepThreads:
    def __init__(self):
        self._lock = threading.Lock()
        self._full: int | None = None  # the count before the first child; None while none compiles
        self._restored: int | None = None  # the count given back when the last child ended
        # The engines (ids of their owners) whose child runs, each with how to ask whether it
        # still does: an idle engine whose child ended says nothing, and must not keep the other
        # engines' steps a thread short.
        self._compiling: dict[int, Callable[[], bool]] = {}
        self._lowered: set[int] = set()  # threads that stepped with a thread fewer and not since
        # Engines dropped while their child ran, forgotten at the next call that takes the lock:
        # the finalizer that reports them may run inside a garbage collection that an allocation
        # under the lock set off, in the thread that holds it.
        self._dropped: queue.SimpleQueue[int] = queue.SimpleQueue()

    def update(self, owner: object, compiling: bool, still_compiling: Callable[[], bool] = lambda: True) -> None:
        """Before a step of `owner`'s engine: whether its child still compiles (and how to ask
        later, without a reference to `owner`). A thread fewer while any engine's child does; the
        count from before once none does."""
        me = threading.get_ident()
        with self._lock:
            self._drop_ended_locked()
            if compiling and id(owner) not in self._compiling and still_compiling():
                self._compiling[id(owner)] = still_compiling
                # An engine dropped while its child ran must not keep the others' steps lowered.
                weakref.finalize(owner, self._forget, id(owner))
            elif not compiling:
                self._compiling.pop(id(owner), None)
            if self._compiling:
                if self._full is None:
                    self._settle_locked(me)  # a thread still lowered by an earlier compile
                    self._full = torch.get_num_threads()
                self._lowered.add(me)
                _set_threads(max(1, self._full - 1))
            elif self._full is not None:  # the last child has ended
                self._end_lowering_locked()
                self._lowered.discard(me)
                _set_threads(self._restored)  # also the default of threads yet to run parallel work
            else:
                self._settle_locked(me)

    def settle(self) -> None:
        """Before any step: the count from before, in a thread that last stepped with a thread
        fewer while no child compiles any more (costs a set lookup otherwise)."""
        me = threading.get_ident()
        if me in self._lowered:
            with self._lock:
                self._drop_ended_locked()
                self._end_lowering_locked()
                self._settle_locked(me)

    def _drop_ended_locked(self) -> None:
        """Forget the engines dropped, and those whose child has ended, whether or not they
        stepped since."""
        while True:
            try:
                self._compiling.pop(self._dropped.get_nowait(), None)
            except queue.Empty:
                break
        for key, still_compiling in list(self._compiling.items()):
            if not still_compiling():
                self._compiling.pop(key, None)

    def _settle_locked(self, me: int) -> None:
        if self._full is None and me in self._lowered:
            self._lowered.discard(me)
            _set_threads(self._restored)

    def _end_lowering_locked(self) -> None:
        """Once no child compiles: the count from before is what lowered threads settle to."""
        if not self._compiling and self._full is not None:
            self._restored, self._full = self._full, None

    def _forget(self, key: int) -> None:
        self._dropped.put(key)  # (no lock: see `_dropped`); lowered threads settle at their next step

    def full_threads(self) -> int:
        """The count steps have with no child compiling: what a graph is compiled for (and keyed
        by), also in a thread still lowered by a compile that has ended (its compile runs after
        the step settled it)."""
        with self._lock:
            self._drop_ended_locked()
            self._end_lowering_locked()
            if self._full is not None:
                return self._full
            if threading.get_ident() in self._lowered and self._restored is not None:
                return self._restored
            return torch.get_num_threads()

    @contextmanager
    def all_threads(self):
        """Every thread, for a compile in this process (a blocking engine's, or a graph whose
        file failed to load) while a child compiles: the count is written into the graph."""
        with self._lock:
            full = self._full
        lowered = torch.get_num_threads()
        if full is None or lowered == full:
            yield
            return
        torch.set_num_threads(full)
        try:
            yield
        finally:
            torch.set_num_threads(lowered)


def _set_threads(count: int) -> None:
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


STEP_THREADS = StepThreads()
