"""AsyncLLM: the asyncio face of the background engine loop.

One loop thread owns the engine (`BackgroundEngine`); any number of asyncio tasks submit to it
and read their request's outputs without blocking the event loop. The loop thread hands a step's
outputs to the event loop in one `call_soon_threadsafe`, which puts each into its request's own
asyncio queue.

Ownership follows the sync streams': an `AsyncRequestStream` owns its request from the moment
it is returned. Cancelling the task that reads it, `aclose()`, leaving its `async with` block, or
dropping it before its final output aborts the request, and the loop frees its KV blocks before
its next step. Every request ends with exactly one final output ("stop", "length", "abort" or
"error").
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastgen.engine.background import END, BackgroundEngine
from fastgen.engine.prompts import Prompt, prompt_size
from fastgen.engine.stats import EngineStats
from fastgen.outputs import RequestOutput
from fastgen.sampling_params import SamplingParams

if TYPE_CHECKING:
    from fastgen.llm import LLM

# Prompts up to this many characters (or token ids) are made ready on the event loop (a few
# hundred microseconds at most, about what handing them to a worker thread costs); longer ones
# in a worker thread.
TOKENIZE_INLINE_MAX_CHARS = 1000


class _EventLoopPost:
    """Takes the outputs the engine's loop thread puts for one event loop's requests, and hands
    them over together at `flush`: one `call_soon_threadsafe` (a wake-up of the event loop, a
    write to its self-pipe) a step, however many of its requests the step moved. Made in the
    event loop's thread; `put` and `flush` run in the engine's loop thread only."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._pending: list[tuple[asyncio.Queue, object]] = []

    def put(self, outputs: asyncio.Queue, item: object) -> None:
        self._pending.append((outputs, item))

    def flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        try:
            self._loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the event loop is closed: nobody is left to read
            pass


def _deliver(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for outputs, item in batch:
        outputs.put_nowait(item)


class _EventLoopSink:
    """Feeds one request's asyncio queue from the engine's loop thread, through its event loop's
    post (delivered at `flush`, which the loop calls after every batch of puts)."""

    def __init__(self, post: _EventLoopPost, outputs: asyncio.Queue):
        self._post = post
        self._outputs = outputs

    def put(self, item: object) -> None:
        self._post.put(self._outputs, item)

    def flush(self) -> None:
        self._post.flush()


class AsyncRequestStream:
    """Async iterator over one request's outputs (deltas in new_text / new_token_ids) up to and
    including its final one."""

    def __init__(self, request_id: str, outputs: asyncio.Queue, background: BackgroundEngine):
        self.request_id = request_id
        self.final: RequestOutput | None = None
        self._outputs = outputs
        self._background = background
        self._closed = False
        self._finalizer = weakref.finalize(self, background._abandon, request_id)
        self._finalizer.atexit = False

    def __aiter__(self) -> "AsyncRequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        try:
            item = await self._outputs.get()
        except asyncio.CancelledError:  # the reading task was cancelled: the request goes too
            self.close()
            raise
        if item is END:  # the loop stopped without a final output
            self._end()
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.finished:
            self.final = item
            self._end()
        return item

    def close(self) -> None:
        """Stop reading; a request without its final output yet is aborted."""
        if not self._closed:
            self._end()
            self._background.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> "AsyncRequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def _end(self) -> None:
        self._closed = True
        self._finalizer.detach()


class AsyncLLM:
    """Serves an `LLM` to asyncio tasks through one background loop thread.

    `await submit(prompt, params)` queues a request and returns its stream (ValueError for a bad
    request, EngineOverloaded beyond max_waiting_requests, both raised in the awaiting task);
    `generate_async` wraps that in an async generator. `shutdown()` aborts what is unfinished.
    With final_only=True a stream yields the request's final output alone: where only the whole
    answer is wanted, the engine then makes no output a step for it and none crosses to the
    event loop before the end (`LLM.generate`'s way).
    """

    def __init__(self, llm: "LLM"):
        self.llm = llm
        self.background = llm.background()
        # One post per event loop that submits (usually one): made in that loop's thread, then
        # used by the engine's loop thread alone.
        self._posts: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _EventLoopPost] = (
            weakref.WeakKeyDictionary())

    @property
    def stats(self) -> EngineStats:
        """The loop's latest snapshot of the engine's load and counters."""
        return self.background.stats

    @property
    def running(self) -> bool:
        return self.background.running

    async def submit(self, prompt: Prompt, params: SamplingParams | None = None,
                     final_only: bool = False) -> AsyncRequestStream:
        loop = asyncio.get_running_loop()
        # A grammar compiles, a long text tokenizes and a long list of ids is checked off the
        # event loop: its other tasks (a server's streams) would wait for them.
        if getattr(params, "structured_outputs", None) is not None or prompt_size(prompt) > TOKENIZE_INLINE_MAX_CHARS:
            prompt = await asyncio.to_thread(self.background.prepare_input, prompt, params)
        outputs: asyncio.Queue = asyncio.Queue()
        post = self._posts.get(loop)
        if post is None:
            post = self._posts[loop] = _EventLoopPost(loop)
        accepted = self.background.add(prompt, params, _EventLoopSink(post, outputs), final_only)
        try:
            request_id = await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:  # cancelled while the loop took it: abort it once it is in
            accepted.add_done_callback(self._abort_if_accepted)
            raise
        return AsyncRequestStream(request_id, outputs, self.background)

    async def generate_async(self, prompt: Prompt, params: SamplingParams | None = None,
                             final_only: bool = False) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come, ending with its final one (`submit`'s
        final_only). Cancelling the consuming task (or closing this generator) aborts the request."""
        async with await self.submit(prompt, params, final_only) as stream:
            async for output in stream:
                yield output

    async def abort(self, request_id: str) -> None:
        """Abort a request (no-op for an unknown or finished one); its stream ends with "abort"."""
        self.background.abort(request_id)

    def abort_all(self) -> None:
        """Abort every unfinished request (without waiting: callable from the event loop); each
        stream ends with "abort"."""
        self.background.abort_all()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop thread; unfinished requests end with "abort" (blocking: from a
        coroutine, run it with asyncio.to_thread)."""
        self.background.shutdown(timeout)

    def _abort_if_accepted(self, accepted) -> None:
        if not accepted.cancelled() and accepted.exception() is None:
            self.background.abort(accepted.result())
