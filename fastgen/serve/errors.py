"""OpenAI-style error bodies and the handlers that turn exceptions into them.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

ValueError (the engine's and SamplingParams' checks, which name the field, the value and the
limit) and pydantic's validation errors (bad JSON, wrong types) are 400s; EngineOverloaded is a
503 with Retry-After; EngineDeadError (the engine is down for good) a 503 without one; an unknown
model or result id is a 404, and so are unknown paths (a known path with the wrong method is a
405). A handler answers one request: the server and the other requests go
on.
"""

from __future__ import annotations

import json
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from fastgen.engine.requests import EngineOverloaded
from fastgen.errors import EngineDeadError

# "temperature=-1 must be ...", "stop must hold ...", "prompt length 900 + ...": the field
# a check message starts with.
_FIELD = re.compile(r"^(?:prompt token_ids|([A-Za-z_]+))[\w.\[\]$]*?(?: key)?"
                    r"(?:=| length| holds| names| has| is| must| cannot)")


class RequestError(ValueError):
    """A bad request whose field is known (param)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param = param
        self.status = status
        self.kind = kind


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _param_of(message: str) -> str | None:
    match = _FIELD.match(message)
    if match is None:
        return None
    return match.group(1) or "prompt"


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    field = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('msg')}", None
    value = first.get("input")
    try:
        shown = json.dumps(value)[:200]
    except (TypeError, ValueError):
        shown = repr(value)[:200]
    return f"{field or 'body'}={shown}: {first.get('msg')}", field


def install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        message, field = _describe_validation(exc)
        return error_response(400, message, "invalid_request_error", field)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException):
        # Starlette's own: no such path (404), a path without this method (405, with Allow).
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind,
                              headers=exc.headers)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        return error_response(exc.status, str(exc), exc.kind, exc.param)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError):
        return error_response(400, str(exc), "invalid_request_error", _param_of(str(exc)))

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, exc: EngineDeadError):
        # The engine is down for good (a tensor-parallel rank or host lost): /health says so too.
        return error_response(503, f"the engine is down: {exc}", "service_unavailable")

    @app.exception_handler(EngineOverloaded)
    async def on_overloaded(request: Request, exc: EngineOverloaded):
        return error_response(503, f"the server is overloaded: {exc}; retry later", "service_unavailable",
                              headers={"Retry-After": str(retry_after_s)})
