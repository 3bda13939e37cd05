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
from contextlib import contextmanager


@contextmanager
def interrupts_held_back():
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if received:
            raise KeyboardInterrupt
