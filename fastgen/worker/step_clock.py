"""How long the device waits for the host between steps (exposed host time), step by step.

Each step's device work is bracketed by two marks: `begin` just before its first device work
(the input upload) and `end` after its last (the copy of the sampled ids). The device is idle
from one step's end to the next step's begin unless the host queued that next step before the
device got there: that gap is the host time the device waited for. With overlap scheduling the
next step is queued while the device still computes, so the gap should be near zero; steps in
turn expose all the host's work between two launches (post-processing, scheduling, inputs).

CUDA: timing events, read once they are complete (`take`). CPU: the model runs in the host's own
thread, so the host clock around the device work is the device's time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepTimes:
    """Seconds, one entry per step: `idle` the device's wait before the step (the first step
    after a `pause` has none), `busy` the step's own device time."""

    idle: list[float]
    busy: list[float]


class StepClock:
    def __init__(self, device: torch.device):
        self.on_cuda = device.type == "cuda"
        self._marks: list[tuple[object, object]] = []  # (begin, end) per step since the last take
        self._previous_end: object | None = None
        self._idle: list[float] = []
        self._busy: list[float] = []

    def _mark(self) -> object:
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        self._pending_begin = self._mark()

    def end(self) -> None:
        self._marks.append((self._pending_begin, self._mark()))

    def pause(self) -> None:
        """A pause in the work (peers run, an iteration ends): the next step's wait is not counted."""
        self.take()
        self._previous_end = None

    def take(self) -> StepTimes:
        """Every step's times since the clock was made (waits for the device on CUDA)."""
        for begin, end in self._marks:
            if self._previous_end is not None:
                self._idle.append(self._seconds(self._previous_end, begin))
            self._busy.append(self._seconds(begin, end))
            self._previous_end = end
        self._marks.clear()
        return StepTimes(list(self._idle), list(self._busy))

    def _seconds(self, start: object, stop: object) -> float:
        if not self.on_cuda:
            return max(0.0, stop - start)
        stop.synchronize()
        return max(0.0, start.elapsed_time(stop) / 1000.0)
