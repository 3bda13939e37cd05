"""Errors that end an engine, as opposed to a request.

A failed step is normally one request's problem: the engine retries its batch one sequence at a
time and ends only the request that fails alone (see `LLMEngine`). Some failures leave nothing to
retry with: a tensor-parallel rank that died, say. Those raise `EngineDeadError` out of
`step()`, `generate()` and the streams; the engine is unusable afterwards and a new one must be
built.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot run another step; build a new one."""
