"""Which thread may drive an engine: any (one at a time, the caller's promise) until a background
loop attaches; then only the loop's thread, and every other thread gets a RuntimeError instead
of racing it. One engine, one loop."""

from __future__ import annotations

import threading


class Driver:
    def __init__(self):
        self._loop: threading.Thread | None = None
        self._lock = threading.Lock()

    def attach(self, thread: threading.Thread, num_left: int) -> None:
        """Let only `thread` drive from now on. num_left: requests and undelivered outputs the
        engine still holds, which the loop would have no consumer for (RuntimeError unless 0)."""
        with self._lock:
            if self._loop is not None:
                raise RuntimeError("a background loop already drives this engine: use the object LLM.background() "
                                   "returned, or shut it down before starting another")
            if num_left:
                raise RuntimeError(f"the engine still has {num_left} unfinished request(s) or undelivered output(s) "
                                   "(an open stream?); finish, read or abort them before starting a background loop")
            self._loop = thread

    def detach(self, thread: threading.Thread) -> None:
        with self._lock:
            if self._loop is thread:
                self._loop = None

    def is_current(self) -> bool:
        """Whether the calling thread may drive the engine."""
        loop = self._loop
        return loop is None or threading.current_thread() is loop

    def check(self) -> None:
        if not self.is_current():
            raise RuntimeError("this engine is driven by a background loop (LLM.background()): submit, stream and "
                               "abort through it, or shut it down first")
