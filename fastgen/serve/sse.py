"""Server-sent events: each event a `data: <json>` line and a blank line, then `data: [DONE]`.

Starlette cancels the response's task when the client disconnects; the cancellation reaches
the request stream being read, which aborts its request (see `AsyncRequestStream`).

A client that stays connected but stops reading is found by the socket's flow control: once the
buffers between us fill, sending the next event waits. If one event waits longer than
`idle_timeout_s`, the stream is closed: its request is aborted and its KV blocks freed, so a
reader that went away cannot hold a sequence. (The connection itself is closed by uvicorn once
its buffered bytes are read or the client leaves: ASGI gives no way to cut it sooner.) A reader
slower than the buffers' size per `idle_timeout_s` counts as idle too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

logger = logging.getLogger(__name__)


class _IdleLimitedResponse(StreamingResponse):
    def __init__(self, *args, idle_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.idle_timeout_s = idle_timeout_s

    async def stream_response(self, send) -> None:
        async def bounded(message) -> None:
            await asyncio.wait_for(send(message), self.idle_timeout_s)

        try:
            await super().stream_response(bounded)
        except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11, two before
            logger.warning("a stream's client read nothing for %.0f s (stream_idle_timeout_s): its request is "
                           "aborted", self.idle_timeout_s)
            await self.body_iterator.aclose()  # ends the request stream: the request is aborted


def sse_response(events: AsyncIterator[dict], idle_timeout_s: float) -> StreamingResponse:
    async def body():
        async with contextlib.aclosing(events):  # closing the body closes the events, and so the request
            async for event in events:
                yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
        yield "data: [DONE]\n\n"

    return _IdleLimitedResponse(body(), media_type="text/event-stream", idle_timeout_s=idle_timeout_s,
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
