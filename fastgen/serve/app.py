"""The FastAPI application and the uvicorn server around it.

    build_app(llm, settings) -> FastAPI       routes, error handlers, the engine's lifespan
    serve(llm, settings)                      run until SIGINT / SIGTERM, then shut down cleanly

Shutdown: on the signal the server stops admitting (new requests get 503), uvicorn stops
accepting connections and lets in-flight requests finish for up to `shutdown_timeout_s`; then
the engine aborts whatever is left, so that each request still gets its answer, a stream its
final chunk, with finish_reason "abort" (uvicorn's own timeout, which cancels the handlers
mid-response, comes `FINAL_OUTPUTS_S` later, as a last resort).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request, Response

from fastgen.checks import integer
from fastgen.engine.async_llm import AsyncLLM
from fastgen.engine.tokenizer import load_tokenizer
from fastgen.serve import generate_routes, openai_routes, tokenize_routes
from fastgen.serve.errors import install_error_handlers
from fastgen.serve.front_door import FrontDoor
from fastgen.serve.metrics import CONTENT_TYPE
from fastgen.serve.results import ResultStore
from fastgen.serve.state import ServerState

logger = logging.getLogger(__name__)

# After the shutdown timeout aborts the unfinished requests: how long their handlers have to
# send the final outputs before uvicorn cancels them.
FINAL_OUTPUTS_S = 5.0


@dataclass(frozen=True)
class ServerSettings:
    """host / port: where to listen. model_name: the name /v1/models reports and requests must
    use (default: the model folder's name). max_results / result_ttl_s: how many finished
    /generate results are kept, and for how long (seconds). retry_after_s: the Retry-After of a
    503. shutdown_timeout_s: how long in-flight requests may finish after SIGINT / SIGTERM.

    The front door (`front_door.py`): api_key: the key every route but /health (and /metrics,
    unless metrics_require_key) requires as `Authorization: Bearer <key>` (None: open; never
    printed, not even in this object's repr). max_request_bytes: larger bodies get 413 before
    they are parsed. max_connections: beyond this many open connections, 503 at once (uvicorn's
    limit_concurrency, one more: uvicorn counts the connection asking, and refuses at the
    limit). stream_idle_timeout_s: a stream whose client reads nothing for this long is aborted
    and its connection dropped."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    max_results: int = 1024
    result_ttl_s: float = 600.0
    retry_after_s: int = 1
    shutdown_timeout_s: float = 5.0
    api_key: str | None = field(default=None, repr=False)
    metrics_require_key: bool = False
    max_request_bytes: int = 32 << 20
    max_connections: int = 1024
    stream_idle_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            # An unset secret in a template must not quietly mean "no key".
            raise ValueError("api_key is empty: set a key, or leave it unset (None) to serve without one")
        integer("max_connections", self.max_connections, minimum=1)


def build_app(llm, settings: ServerSettings) -> FastAPI:
    """The app serving `llm` (an `LLM` with a tokenizer); the engine loop starts and stops with
    the app's lifespan."""
    tokenizer = load_tokenizer(llm.config.model) if llm.tokenizer is not None else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        config = llm.config
        state = ServerState(AsyncLLM(llm), settings.model_name or Path(config.model).name, tokenizer,
                            config.max_model_len, config.model_config.vocab_size,
                            min(config.max_logprobs, config.model_config.vocab_size),
                            ResultStore(settings.max_results, settings.result_ttl_s),
                            stream_idle_timeout_s=settings.stream_idle_timeout_s)
        app.state.server = state
        try:
            yield
        finally:
            state.accepting = False
            if state.background_tasks:
                # /generate's requests, which no connection holds open: the same time to finish as
                # the others (the server aborts what is left at the shutdown timeout).
                await asyncio.wait(state.background_tasks, timeout=settings.shutdown_timeout_s + FINAL_OUTPUTS_S)
            await asyncio.to_thread(state.llm.shutdown)  # aborts the unfinished: their streams end
            if state.background_tasks:
                await asyncio.wait(state.background_tasks, timeout=FINAL_OUTPUTS_S)

    app = FastAPI(title="fastgen", lifespan=lifespan)
    app.add_middleware(FrontDoor, api_key=settings.api_key, max_request_bytes=settings.max_request_bytes,
                       metrics_require_key=settings.metrics_require_key)
    install_error_handlers(app, settings.retry_after_s)
    app.include_router(openai_routes.router)
    app.include_router(generate_routes.router)
    app.include_router(tokenize_routes.router)

    @app.get("/health")
    async def health(request: Request) -> Response:
        state: ServerState = request.app.state.server
        healthy = state.accepting and state.llm.running
        return Response(status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.server.metrics.render(), media_type=CONTENT_TYPE)

    return app


class Server(uvicorn.Server):
    """uvicorn's server, which on SIGINT / SIGTERM first stops the app admitting requests and,
    once shut down cleanly, returns (exit status 0) instead of re-raising the signal."""

    def __init__(self, app: FastAPI, settings: ServerSettings):
        super().__init__(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                                        timeout_graceful_shutdown=settings.shutdown_timeout_s + FINAL_OUTPUTS_S,
                                        limit_concurrency=settings.max_connections + 1))
        self._app = app
        self._shutdown_timeout_s = settings.shutdown_timeout_s

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's shutdown, with the unfinished requests aborted once `shutdown_timeout_s` has
        passed: their handlers then answer them (finish_reason "abort") and return."""
        abort = asyncio.get_running_loop().call_later(self._shutdown_timeout_s, self._abort_unfinished)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()

    def _abort_unfinished(self) -> None:
        state = getattr(self._app.state, "server", None)
        if state is not None:
            logger.warning("shutdown timeout (%.1fs) passed: aborting the unfinished requests",
                           self._shutdown_timeout_s)
            state.abort_unfinished()

    def handle_exit(self, sig, frame) -> None:
        state = getattr(self._app.state, "server", None)
        if state is not None:
            state.accepting = False
        super().handle_exit(sig, frame)
        getattr(self, "_captured_signals", []).clear()  # handled: do not re-raise it after shutdown


def bind(settings: ServerSettings) -> socket.socket:
    """A socket bound to settings' host and port (port 0: a free one, which `getsockname` then
    gives): `fastgen serve` holds the port with it while the model loads. ValueError naming the
    address when it cannot be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        # Bound, not listening: a port a running server holds fails here, before the model loads,
        # while clients that connect during the load are refused at once rather than left waiting
        # on a server that cannot answer yet. (Two servers started together may both bind under
        # SO_REUSEADDR; the second then fails when uvicorn listens.)
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on host={settings.host!r} port={settings.port}: "
                         f"{exc.strerror or exc}") from None
    return sock


def serve(llm, settings: ServerSettings, sock: socket.socket | None = None) -> None:
    """Serve until SIGINT / SIGTERM (or `should_exit`); sock: an already bound socket."""
    server = Server(build_app(llm, settings), settings)
    # What is alive now (torch, transformers, the model, the app: about 200,000 objects) lives as
    # long as the process. Frozen out of the collector's reach, a full collection walks only what
    # requests left behind: on the default model's server it took 102-131 ms, a pause every
    # stream felt, and takes 3 ms.
    gc.collect()
    gc.freeze()
    port = sock.getsockname()[1] if sock is not None else settings.port
    logger.info("serving %s on http://%s:%d", llm.config.model, settings.host, port)
    server.run(sockets=[sock] if sock is not None else None)
