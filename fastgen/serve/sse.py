"""Server-sent events: each event a `data: <json>` line and a blank line, then `data: [DONE]`.

Starlette cancels the response's task when the client disconnects; the cancellation reaches
the request stream being read, which aborts its request (see `AsyncRequestStream`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse


def sse_response(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        async for event in events:
            yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
