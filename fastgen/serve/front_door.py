"""What every request passes before any route sees it: the API key, and the body's size.

An ASGI middleware (under FastAPI, before routing and before the body is parsed):

- **API key**: with a key set, every path but `/health` (and `/metrics`, unless
  `metrics_require_key`) needs `Authorization: Bearer <key>`; otherwise 401. The comparison
  takes the same time whatever the key sent (`hmac.compare_digest`), and the key is never logged
  or echoed.
- **Body size**: a body over `max_request_bytes` is a 413: at once when its Content-Length says
  so, else as soon as the bytes read pass the limit (a chunked upload); the route then sees a
  disconnect and answers nothing more.
"""

from __future__ import annotations

import hmac
import json

OPEN_PATHS = ("/health",)


def _error(status: int, message: str, kind: str) -> tuple[dict, dict]:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return ({"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body})


class FrontDoor:
    def __init__(self, app, api_key: str | None, max_request_bytes: int, metrics_require_key: bool = False):
        self.app = app
        self._key = None if not api_key else f"Bearer {api_key}".encode()
        self.max_request_bytes = max_request_bytes
        self.open_paths = OPEN_PATHS if metrics_require_key else (*OPEN_PATHS, "/metrics")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self._key is not None and scope["path"] not in self.open_paths:
            # compare_digest on bytes of any length: its time does not depend on where they differ
            if not hmac.compare_digest(headers.get(b"authorization", b""), self._key):
                return await self._refuse(send, 401, "a valid API key is required: Authorization: Bearer <key>",
                                          "authentication_error")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            return await self._refuse(send, 413, self._too_large(), "invalid_request_error")
        refused = []  # this request's: set once its body passed the limit
        await self.app(scope, self._counting(receive, send, refused), self._unless_refused(send, refused))

    def _too_large(self) -> str:
        return f"the request body is larger than this server's max_request_bytes={self.max_request_bytes}"

    async def _refuse(self, send, status: int, message: str, kind: str) -> None:
        start, body = _error(status, message, kind)
        await send(start)
        await send(body)

    def _counting(self, receive, send, refused: list):
        """receive, refusing a body that grows past the limit (a 413, then a disconnect for the app)."""
        read = 0

        async def counted():
            nonlocal read
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_request_bytes:
                    refused.append(True)
                    await self._refuse(send, 413, self._too_large(), "invalid_request_error")
                    return {"type": "http.disconnect"}
            return message

        return counted

    @staticmethod
    def _unless_refused(send, refused: list):
        async def guarded(message):
            if not refused:  # after a 413, the app's own answer has nowhere to go
                await send(message)

        return guarded
