"""A background engine loop that many threads can submit to and stream from.

Threading model: exactly one thread — the loop thread started here — ever touches the
`LLMEngine` (its scheduler, block manager, model and tokenizer state); the engine refuses every
other thread while the loop is attached, and one engine gets one loop at a time. Other threads
talk to the loop through a command queue: `submit` and `abort` enqueue a command and, for
`submit`, wait for the loop to accept or reject it, so a bad request raises ValueError in the
caller's thread. Each request's outputs flow back through its own sink (anything with a
non-blocking `put`): a queue its `RequestStream` reads, or an asyncio queue fed through the event
loop (`fastgen.engine.async_llm`). The loop holds those sinks, never the streams, so a stream
nobody holds is garbage-collected, and its finalizer queues the request's abort. After every
step the loop publishes `stats`, an `EngineStats` snapshot any thread may read. Starting the
loop ends the OpenMP worker threads of the thread that starts it (`release_openmp_threads`), so
that the loop's CPU steps run as fast as they did there; torch's CPU work in other threads while
the loop runs slows its steps.

A failed step never stops the loop: the engine isolates it (see `LLMEngine`), and the requests
it belongs to end with finish_reason "error".
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Protocol

import torch

from fastgen.cpu.native.openmp import release_openmp_threads
from fastgen.engine.llm_engine import LLMEngine, Prompt
from fastgen.engine.output_stream import OutputStream
from fastgen.engine.prompts import tokenized_prompt
from fastgen.engine.requests import check_request_id
from fastgen.engine.stats import EngineStats
from fastgen.errors import EngineDeadError
from fastgen.outputs import RequestOutput
from fastgen.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

END = object()  # put into a sink when no final output will come: the loop stopped without one
# How often an idle loop asks whether the engine can still run (a tensor-parallel rank that died
# between requests): a server's /health then says so within about this long.
IDLE_CHECK_S = 0.5


class OutputSink(Protocol):
    """Where the loop puts a request's outputs. A sink may also have `flush()`, which the loop
    calls after each batch of puts (a step's outputs): one that holds items back to deliver them
    together (`fastgen.engine.async_llm`) must deliver them then. Neither may block or raise."""

    def put(self, item: object) -> None:
        """Called from the loop thread with a RequestOutput, `END` or an exception."""


def _flush(sinks: Iterable[OutputSink]) -> None:
    for sink in sinks:
        flush = getattr(sink, "flush", None)
        if flush is not None:
            flush()


class RequestStream(OutputStream):
    """Iterates one submitted request's outputs until its final one (see `OutputStream`)."""

    def __init__(self, request_id: str, outputs: queue.SimpleQueue, owner: "BackgroundEngine"):
        super().__init__(request_id, owner._abandon)
        self._outputs = outputs
        self._owner = owner

    def _next_output(self) -> RequestOutput | None:
        item = self._outputs.get()
        if item is END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def _abort(self) -> None:
        self._owner.abort(self.request_id)


class BackgroundEngine:
    """Owns `engine` through a loop thread until `shutdown()`. RuntimeError when another loop
    already drives the engine, or when the engine still has requests of its own."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, OutputSink] = {}  # request id -> where its outputs go
        self.stats: EngineStats = engine.stats()
        self._stopped = threading.Event()
        # Held while checking _stopped and queueing a command, and while the loop stops and
        # drains the queue: so a command is either seen by the loop or refused, never stranded.
        self._accepting = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="fastgen-engine-loop", daemon=True)
        # The steps leave this thread, which holds OpenMP workers if it ran the model (a warm-up,
        # a `generate`): beside them, the loop thread's own would sleep between parallel regions,
        # and its CPU steps run at a fifth to half their speed (`fastgen.cpu.native.openmp`).
        release_openmp_threads()
        engine.attach_loop(self._thread)
        self._thread.start()

    # ---- any thread ------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: SamplingParams | None = None, final_only: bool = False) -> RequestStream:
        """Queue a request; raises ValueError (in this thread) if the engine rejects it, and
        EngineOverloaded when too many requests wait. final_only: its stream yields its final
        output alone (the engine makes none before)."""
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        accepted = self.add(prompt, params, outputs, final_only)
        try:
            request_id = accepted.result()
        except BaseException:
            # Interrupted while waiting (Ctrl-C: no stream will ever read the request): the loop
            # never adds it if the future is cancelled in time, and aborts it once added if not.
            if not accepted.cancel():
                accepted.add_done_callback(self._abandon_added)
            raise
        return RequestStream(request_id, outputs, self)

    def _abandon_added(self, accepted: Future) -> None:
        if not accepted.cancelled() and accepted.exception() is None:
            self._abandon(accepted.result())

    def add(self, prompt: Prompt, params: SamplingParams | None, sink: OutputSink, final_only: bool = False) -> Future:
        """Queue a request whose outputs the loop puts into `sink` (final_only: its final one
        alone). The future resolves to its request id, or to the engine's ValueError /
        EngineOverloaded; RuntimeError at once when the loop has stopped. A ValueError that
        `prepare_input` finds is raised at once."""
        prompt = self.prepare_input(prompt, params)
        accepted: Future = Future()
        with self._accepting:
            if self._stopped.is_set():
                raise RuntimeError("the background engine has shut down") from self._error
            self._commands.put(("add", sink, prompt, SamplingParams() if params is None else params, final_only,
                                accepted))
        return accepted

    def prepare_input(self, prompt: Prompt, params: SamplingParams | None) -> Prompt:
        """The part of adding a request that needs none of the engine's state, done in the calling
        thread so that the loop's steps never wait on it: a text prompt is tokenized, or a list
        of token ids checked to be integers (either returned as a `TokenizedPrompt`; a long one
        takes milliseconds, and the loop would hold every running stream for them), and a
        structured-output grammar is compiled into the cache (the loop then finds it there).
        ValueError for input the engine would refuse."""
        spec = getattr(params, "structured_outputs", None)
        if spec is not None:
            self.engine.structured.compile(spec)
        return tokenized_prompt(self.engine.tokenizer, prompt, self.engine.config.max_model_len)

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op for an unknown or finished one); its stream then yields a
        final output with finish_reason "abort". ValueError when the id is not a string."""
        check_request_id(request_id)
        with self._accepting:
            if not self._stopped.is_set():
                self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every request the loop holds now (without waiting); each stream then yields a
        final output with finish_reason "abort". The loop keeps running."""
        with self._accepting:
            if not self._stopped.is_set():
                self._commands.put(("abort_all",))

    def _abandon(self, request_id: str) -> None:
        # A stream's finalizer, run by whatever thread collects it: SimpleQueue.put is reentrant,
        # a lock is not (that thread may hold _accepting).
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop: unfinished requests are aborted (their streams end with that final
        output) and the engine can be driven directly again."""
        self._commands.put(("stop",))
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return not self._stopped.is_set()

    def __enter__(self) -> "BackgroundEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- the loop thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            device = self.engine.config.torch_device
            if device.type == "cuda":  # the current device is per thread
                torch.cuda.set_device(device)
            while True:
                idle = not self.engine.has_unfinished_requests()
                if not self._apply_commands(block=idle):
                    break
                self._route(self.engine.step())
                self.stats = self.engine.stats()
        except BaseException as exc:  # the engine isolates failed steps: this is the loop's own bug
            if isinstance(exc, EngineDeadError):  # (or the engine is down for good: its cause says why)
                logger.error("the engine is down: %s", exc)
            else:
                logger.exception("background engine loop failed")
            self._error = exc
            for outputs in self._streams.values():
                outputs.put(exc)
            _flush(self._streams.values())
        finally:
            with self._accepting:
                self._stopped.set()
            self._refuse_queued_commands()
            self._abort_all()
            self.engine.detach_loop(self._thread)

    def _route(self, outputs: list[RequestOutput]) -> None:
        sinks: list[OutputSink] = []
        try:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                stream.put(output)
                sinks.append(stream)
                if output.finished:
                    del self._streams[output.request_id]
        finally:  # what was put is delivered, even a finished stream's that left `_streams`
            _flush(sinks)

    def _abort_all(self) -> None:
        """Nobody will drive these requests again: abort them and deliver their final outputs."""
        try:
            for request_id in list(self._streams):
                self.engine.abort(request_id)
            self._route(self.engine.step())  # no work is left: this only hands out the finals
        except Exception:  # noqa: BLE001 - the streams must end even if the engine is what failed
            logger.exception("aborting the background engine's requests failed")
        for outputs in self._streams.values():
            outputs.put(END)
        _flush(self._streams.values())
        self._streams.clear()

    def _refuse_queued_commands(self) -> None:
        stopped = RuntimeError("the background engine has shut down")
        while True:
            try:
                command = self._commands.get(block=False)
            except queue.Empty:
                return
            if command[0] == "add" and command[-1].set_running_or_notify_cancel():
                command[-1].set_exception(stopped)

    def _apply_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one when idle, and asking the engine every
        IDLE_CHECK_S whether it can still run: a server says so at /health); False once asked to
        stop."""
        while True:
            try:
                command = self._commands.get(block=block, timeout=IDLE_CHECK_S if block else None)
            except queue.Empty:
                if block:
                    self.engine.check_alive()  # EngineDeadError ends the loop, as from a step
                    continue
                return True
            block = False
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "add":
                _, outputs, prompt, params, final_only, accepted = command
                # The submitter gave up before the loop took it (a cancelled task): nothing to
                # add. Once running, the future cannot be cancelled, and a submitter that gives
                # up then aborts the request when its id comes (AsyncLLM.submit).
                if not accepted.set_running_or_notify_cancel():
                    continue
                try:
                    request_id = self.engine.add_request(prompt, params, final_only=final_only)
                except Exception as exc:  # rejected request: the submitting thread raises it
                    accepted.set_exception(exc)
                    continue
                self._streams[request_id] = outputs
                accepted.set_result(request_id)
            elif kind == "abort_all":
                for request_id in list(self._streams):
                    self._abort_one(request_id)  # their finals come out of the next step
            elif kind == "abort":
                self._abort_one(command[1])  # its final output comes out of the next step

    def _abort_one(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:  # noqa: BLE001 - one request's abort must not stop the loop
            logger.exception("aborting request %r failed", request_id)
