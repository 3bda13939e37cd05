"""Aborting a non-streaming request whose client has gone.

A streamed response notices a dropped client by itself (Starlette cancels the response's task).
A plain one does not: its handler awaits the final output while nothing is sent. So the handler
races its work against the connection's `http.disconnect` message (as vLLM does); when the
client leaves first, the work is cancelled, and the cancellation reaches the request stream
being read, which aborts its request (see `AsyncRequestStream`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request

T = TypeVar("T")
DISCONNECTED = object()
"""What `unless_disconnected` returns when the client left first."""


async def _disconnect(request: Request) -> None:
    """Return once the client has disconnected. The body is already read, so the next ASGI
    message is `http.disconnect`, which the server sends when the connection closes."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | object:
    """`work`'s result, or DISCONNECTED (with `work` cancelled and awaited) if the client
    disconnects first. A cancelled caller cancels `work` too."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((work_task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work_task
    if work_task.cancelled():
        return DISCONNECTED
    return work_task.result()
