"""A background engine loop that many threads can submit to and stream from.

Threading model: exactly one thread — the loop thread started here — ever touches the
`LLMEngine` (its scheduler, block manager, model and tokenizer state). Other threads talk to it
through a command queue: `submit` and `abort` enqueue a command and, for `submit`, wait for the
loop to accept or reject it, so a bad request raises ValueError in the caller's thread. Each
request's outputs flow back through its own queue, which `RequestStream` iterates. No lock
guards the engine because nothing else reaches it.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import torch

from fastgen.engine.llm_engine import LLMEngine, Prompt
from fastgen.outputs import RequestOutput
from fastgen.sampling_params import SamplingParams

_END = object()


class RequestStream:
    """Iterates one request's outputs (deltas in new_text / new_token_ids) until it finishes.

    Leaving the iteration early (break, close, garbage) aborts the request.
    """

    def __init__(self, request_id: str, owner: "BackgroundEngine"):
        self.request_id = request_id
        self._owner = owner
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = False  # the request finished (its last output was seen)
        self._closed = False  # nothing more will come: iterating again ends at once
        self._last: RequestOutput | None = None

    def __iter__(self) -> Iterator[RequestOutput]:
        if self._closed:
            return
        try:
            while True:
                item = self._queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                self._last = item
                if item.finished:
                    self._done = True
                yield item
                if item.finished:
                    return
        finally:
            self._closed = True
            if not self._done:
                self._owner.abort(self.request_id)

    def result(self) -> RequestOutput:
        """Consume the stream; return the final output. Raises RuntimeError when the request
        was cut off (aborted, or the engine shut down) before it finished."""
        for _ in self:
            pass
        if not self._done:
            raise RuntimeError(f"request {self.request_id!r} ended before it finished (aborted or shut down)")
        return self._last


class BackgroundEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._stopped = threading.Event()
        # Held while checking _stopped and queueing a command, and while the loop stops and
        # drains the queue: so a command is either seen by the loop or refused, never stranded.
        self._accepting = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="fastgen-engine-loop", daemon=True)
        self._thread.start()

    # ---- any thread ------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestStream:
        """Queue a request; raises ValueError (in this thread) if the engine rejects it."""
        stream = RequestStream(f"bg-{next(self._ids)}", self)
        accepted: Future = Future()
        with self._accepting:
            if self._stopped.is_set():
                raise RuntimeError("the background engine has shut down") from self._error
            self._commands.put(("add", stream, prompt, params or SamplingParams(), accepted))
        accepted.result()
        return stream

    def abort(self, request_id: str) -> None:
        with self._accepting:
            if not self._stopped.is_set():
                self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop; unfinished streams end (their iteration stops)."""
        self._commands.put(("stop",))
        self._thread.join(timeout)

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
                for output in self.engine.step():
                    stream = self._streams.get(output.request_id)
                    if stream is None:
                        continue
                    stream._queue.put(output)
                    if output.finished:
                        del self._streams[output.request_id]
        except BaseException as exc:  # a failed step ends every stream with the error
            self._error = exc
            for stream in self._streams.values():
                stream._queue.put(exc)
        finally:
            with self._accepting:
                self._stopped.set()
            self._refuse_queued_commands()
            for request_id, stream in self._streams.items():
                try:  # nobody will drive these requests again: free their blocks
                    self.engine.abort(request_id)
                except Exception:  # noqa: BLE001 - the engine may be what failed
                    pass
                stream._queue.put(_END)
            self._streams.clear()

    def _refuse_queued_commands(self) -> None:
        stopped = RuntimeError("the background engine has shut down")
        while True:
            try:
                command = self._commands.get(block=False)
            except queue.Empty:
                return
            if command[0] == "add":
                command[-1].set_exception(stopped)

    def _apply_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one when idle); False once asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "add":
                _, stream, prompt, params, accepted = command
                try:
                    self.engine.add_request(prompt, params, request_id=stream.request_id)
                except Exception as exc:  # rejected request: the submitting thread raises it
                    accepted.set_exception(exc)
                    continue
                self._streams[stream.request_id] = stream
                accepted.set_result(stream.request_id)
            elif kind == "abort":
                _, request_id = command
                if self.engine.abort(request_id):
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        stream._queue.put(_END)
