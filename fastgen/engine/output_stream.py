"""Iterators over one request's outputs: `EngineStream` (LLM.stream) drives the engine from the
reading thread; `fastgen.engine.background.RequestStream` reads what the loop thread sends.

A stream is an iterator object, not a generator, so that it owns its request from the moment
it is returned: closed (`close()`, the end of a `with` block) or garbage-collected before its
final output, it aborts the request and the request's KV blocks come back, even if it was never
iterated. Breaking out of a `for` loop does not close a stream you still hold.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from fastgen.outputs import RequestOutput

if TYPE_CHECKING:
    from fastgen.engine.llm_engine import LLMEngine


class OutputStream(Iterator[RequestOutput]):
    """Yields one request's outputs (deltas in new_text / new_token_ids) up to and including its
    final one (finished=True; finish_reason "abort" when it was aborted elsewhere).

    on_abandon(request_id): called, from whatever thread collects the stream, when it is
    garbage-collected before its final output; it must only queue the abort (no locks).
    """

    def __init__(self, request_id: str, on_abandon: Callable[[str], None]):
        self.request_id = request_id
        self._final: RequestOutput | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, on_abandon, request_id)
        self._finalizer.atexit = False

    def __next__(self) -> RequestOutput:
        if self._closed:
            raise StopIteration
        output = self._next_output()
        if output is None:  # no final output will come (the loop that served it stopped)
            self._end()
            raise StopIteration
        if output.finished:
            self._final = output
            self._end()
        return output

    def close(self) -> None:
        """Stop reading; a request without its final output yet is aborted at once."""
        if not self._closed:
            self._end()
            self._abort()

    def result(self) -> RequestOutput:
        """Read to the end; return the final output (finish_reason "abort" if it was aborted).
        RuntimeError when this stream was closed, or its loop stopped, before the final output."""
        for _ in self:
            pass
        if self._final is None:
            raise RuntimeError(f"request {self.request_id!r} ended before its final output "
                               "(its stream was closed, or the loop serving it stopped)")
        return self._final

    def __enter__(self) -> "OutputStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _end(self) -> None:
        self._closed = True
        self._finalizer.detach()

    def _next_output(self) -> RequestOutput | None:
        """Block until the request's next output; None when none will ever come."""
        raise NotImplementedError

    def _abort(self) -> None:
        raise NotImplementedError


class EngineStream(OutputStream):
    """LLM.stream's iterator: each `next()` steps the engine from the calling thread until this
    request has an output; other requests progress too, and their outputs stay in the engine for
    their own consumers (other streams, `generate`, `step()`)."""

    def __init__(self, engine: "LLMEngine", request_id: str, on_next: Callable[[], None] | None = None,
                 on_end: Callable[[], None] | None = None):
        """on_next: called in the reading thread before each `next()` drives the engine; on_end:
        called in the thread that ends the stream (reads its final output, closes it, or gets an
        error from `next()`); a stream dropped unread ends in no thread, and calls neither."""
        super().__init__(request_id, engine.abandon)
        self._engine = engine
        self._on_next = on_next
        self._on_end = on_end

    def _end(self) -> None:
        super()._end()
        if self._on_end is not None:
            self._on_end()

    def _next_output(self) -> RequestOutput | None:
        if self._on_next is not None:
            self._on_next()
        try:
            return self._drive()
        except BaseException:
            if self._on_end is not None:
                self._on_end()
            raise

    def _drive(self) -> RequestOutput | None:
        while True:
            output = self._engine.take_output(self.request_id)
            if output is not None:
                return output
            if not self._engine.has_request(self.request_id):  # a request's final output precedes its leaving
                raise RuntimeError(f"request {self.request_id!r} left the engine without a final output")
            self._engine.run_step()

    def _abort(self) -> None:
        self._engine.release(self.request_id)
