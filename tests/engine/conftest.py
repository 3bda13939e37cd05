"""Helpers for the engine tests."""

from __future__ import annotations

from contextlib import contextmanager

STEP_LIMIT = 2_000  # far more than any engine test needs


@contextmanager
def step_limit(engine, limit: int = STEP_LIMIT):
    """Cap the engine's steps: a consumer waiting forever for an output that was dropped fails
    the test with an AssertionError instead of hanging it."""
    run_step = engine.run_step
    count = [0]

    def limited():
        count[0] += 1
        if count[0] > limit:
            raise AssertionError("step limit reached: some consumer waits for an output that never comes")
        return run_step()

    engine.run_step = limited
    try:
        yield
    finally:
        del engine.run_step
