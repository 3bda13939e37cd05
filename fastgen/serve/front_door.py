"""What every request passes before any route sees it: the API key, and the body's size.

An ASGI middleware (under FastAPI, before routing and before the body is parsed):

- **API key**: with a key set, every path but `/health` (and `/metrics`, unless
  `metrics_require_key`) needs `Authorization: Bearer <key>` (the scheme in any case); otherwise
  401. The comparison takes the same time whatever the key sent (`hmac.compare_digest`), and the
  key is never logged or echoed.
- **Body size**: a body over `max_request_bytes` is a 413: at once when its Content-Length says
  so, else as soon as the bytes read pass the limit (a chunked upload); the route then sees a
  disconnect and answers nothing more.
"""

from __future__ import annotations

import hmac

from fastgen.serve.errors import error_response

OPEN_PATHS = ("/health",)
# 413: the rest of the body is not read, so the connection is not reused.
_HEADERS = {401: {"WWW-Authenticate": "Bearer"}, 413: {"Connection": "close"}}


def _bearer_token(authorization: bytes) -> bytes:
    """The credentials of an `Authorization: Bearer <token>` header (the scheme's name in any
    case, as RFC 9110 has it), or b"" for any other header."""
    scheme, _, token = authorization.partition(b" ")
    return token.lstrip(b" ") if scheme.lower() == b"bearer" else b""


class FrontDoor:
    def __init__(self, app, api_key: str | None, max_request_bytes: int, metrics_require_key: bool = False):
        self.app = app
        self._key = None if api_key is None else api_key.encode()
        self.max_request_bytes = max_request_bytes
        self.open_paths = OPEN_PATHS if metrics_require_key else (*OPEN_PATHS, "/metrics")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self._key is not None and scope["path"] not in self.open_paths:
            # compare_digest on bytes of any length: its time does not depend on where they differ
            if not hmac.compare_digest(_bearer_token(headers.get(b"authorization", b"")), self._key):
                return await self._refuse(scope, receive, send, 401,
                                          "a valid API key is required: Authorization: Bearer <key>",
                                          "authentication_error")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            return await self._refuse(scope, receive, send, 413, self._too_large(), "invalid_request_error")
        await self._admit(scope, receive, send)

    def _too_large(self) -> str:
        return f"the request body is larger than this server's max_request_bytes={self.max_request_bytes}"

    @staticmethod
    async def _refuse(scope, receive, send, status: int, message: str, kind: str) -> None:
        await error_response(status, message, kind, headers=_HEADERS.get(status))(scope, receive, send)

    async def _admit(self, scope, receive, send) -> None:
        """Run the app, counting the body it reads: past the limit (and before the app has
        answered), a 413 goes out, the app sees a disconnect, and its own answer goes nowhere."""
        read, refused, answered = 0, False, False

        async def counted():
            nonlocal read, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request" and not answered:
                read += len(message.get("body", b""))
                if read > self.max_request_bytes:
                    refused = True
                    await self._refuse(scope, receive, send, 413, self._too_large(), "invalid_request_error")
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message):
            nonlocal answered
            if refused:
                return
            answered = answered or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted, guarded)
