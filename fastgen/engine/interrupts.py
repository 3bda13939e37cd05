"""Ctrl-C held back while the scheduler forms a step.

`Scheduler.schedule` allocates blocks and marks tokens in flight before it returns the step; a
KeyboardInterrupt raised in between would leave those marks with no step to give them back, and
a request open across the interrupt (a stream, an `add_request`) would decode wrong tokens or
never finish. The engine gives up a step it holds (`LLMEngine._give_up`), so the interrupt is
raised as soon as the step is formed. Only SIGINT under Python's own handler, in the main thread
(where signal handlers run), is held back; a handler the application installed is left alone.
"""

from __future__ import annotations

import signal
import threading


class interrupts_held_back:  # noqa: N801 - used as a context manager, named like one
    """`with interrupts_held_back(): ...`: a SIGINT arriving inside is raised as KeyboardInterrupt
    when the block ends (its cost: two sigaction calls and a lookup); a second one is raised at
    once, so that a block that hangs can still be left."""

    __slots__ = ("_received", "_holding")

    def __enter__(self) -> None:
        self._holding = False
        if threading.current_thread() is not threading.main_thread():
            return
        # The application's own handler is left alone, and so is one installed outside Python
        # (None here); one a C library installed over Python's without telling it cannot be seen.
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return
        self._received = False
        signal.signal(signal.SIGINT, self._hold)
        self._holding = True

    def _hold(self, signum, frame) -> None:
        if self._received:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._holding = False
            raise KeyboardInterrupt
        self._received = True

    def __exit__(self, *exc) -> None:
        if not self._holding:
            return
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if self._received:
            raise KeyboardInterrupt
