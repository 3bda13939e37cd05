"""What every route shares: the engine (`AsyncLLM`), the served model's name and tokenizer, the
metrics, the /generate results, and whether the server still admits requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastgen.engine.async_llm import AsyncLLM, AsyncRequestStream
from fastgen.engine.prompts import Prompt
from fastgen.engine.requests import EngineOverloaded
from fastgen.engine.tokenizer import token_bytes_reader
from fastgen.outputs import RequestOutput
from fastgen.sampling_params import SamplingParams
from fastgen.serve.errors import RequestError
from fastgen.serve.metrics import ServerMetrics
from fastgen.serve.results import ResultStore


@dataclass
class ServerState:
    llm: AsyncLLM
    model_name: str
    tokenizer: object  # the server's own copy: the engine's is used by the loop thread
    max_model_len: int
    vocab_size: int
    max_logprobs: int  # the most top logprobs per token a request may ask for
    results: ResultStore
    stream_idle_timeout_s: float = 60.0  # a stream whose client reads nothing this long is aborted
    metrics: ServerMetrics = field(init=False)
    token_bytes: Callable[[int], bytes | None] = field(init=False)  # chat logprobs' `bytes`
    accepting: bool = True
    aborting: bool = False  # past the shutdown timeout: what is still unfinished is aborted
    background_tasks: set[asyncio.Task] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(lambda: self.llm.stats)
        self.token_bytes = token_bytes_reader(self.tokenizer)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(f"model={model!r} does not exist; this server serves {self.model_name!r}",
                               param="model", status=404, kind="model_not_found")

    async def submit(self, prompt: Prompt, params: SamplingParams, final_only: bool = False) -> AsyncRequestStream:
        """Queue a request (ValueError: 400; EngineOverloaded or shutting down: 503). final_only:
        its stream yields its final output alone."""
        if not self.accepting or not self.llm.running:
            self.metrics.rejected.labels("503").inc()
            raise RequestError("the server is shutting down", status=503, kind="service_unavailable")
        try:
            stream = await self.llm.submit(prompt, params, final_only)
        except EngineOverloaded:
            self.metrics.rejected.labels("503").inc()
            raise
        except ValueError:
            self.metrics.rejected.labels("400").inc()
            raise
        if self.aborting:  # admitted before the shutdown, queued after its abort (a long grammar compile)
            await self.llm.abort(stream.request_id)
        return stream

    def abort_unfinished(self) -> None:
        """Past the shutdown timeout: abort every unfinished request, and any admitted request
        that reaches the engine later; each is still answered, with finish_reason "abort"."""
        self.aborting = True
        self.llm.abort_all()

    async def tracked(self, stream: AsyncRequestStream) -> AsyncIterator[RequestOutput]:
        """The stream's outputs, counted in the metrics; the stream is closed (its request
        aborted if unfinished) however the reader stops."""
        try:
            async with stream:
                async for output in stream:
                    self.metrics.observe(output)
                    yield output
        finally:
            if stream.final is None:  # its reader left first (a dropped client): aborted unread
                self.metrics.finished.labels("abort").inc()
