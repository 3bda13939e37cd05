"""The engine's live requests, and the path their outputs take to their consumers.

Every queued request has a `RequestState` here until its final output is made: under its id, or
for an n > 1 request one per completion under a `ChildId`, with the `ParentRequest` under the
caller's id; and under its sequence's id, which is how a step's sequences find their requests.
Outputs made in a step or by an abort are `deliver`ed: an n > 1 request's completions folded
into one output of the request, then each output handed to the outbox.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from fastgen.engine.outbox import Outbox
from fastgen.engine.parallel_sampling import ChildId, ParentRequest, merge_outputs
from fastgen.engine.request_state import RequestState, now
from fastgen.engine.scheduler import Scheduler
from fastgen.outputs import RequestOutput
from fastgen.sequence import FinishReason, Sequence


class LiveRequests:
    def __init__(self, scheduler: Scheduler, outbox: Outbox, on_forget: Callable[[tuple[int]], None] = lambda _: None):
        """on_forget: called with (seq_id,) when a request's state is dropped (it ended)."""
        self.scheduler = scheduler
        self.on_forget = on_forget
        self.outbox = outbox
        self.states: dict[str | ChildId, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}  # n > 1 requests (their children are in `states`)
        self.by_seq: dict[int, RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states or request_id in self.parents

    def add(self, request: RequestState | ParentRequest) -> None:
        """Register a prepared request and queue it; an n > 1 request queues its first child, and
        the others wait to fork from it once its prompt is computed."""
        if isinstance(request, RequestState):
            self._register(request)
            self.scheduler.add(request.seq)
            return
        self.parents[request.request_id] = request
        for child in request.children:
            self._register(child)
        first, *others = request.children
        self.scheduler.add(first.seq)
        self.scheduler.add_forks(first.seq, [child.seq for child in others])

    def _register(self, state: RequestState) -> None:
        self.states[state.request_id] = state
        self.by_seq[state.seq.seq_id] = state

    def forget(self, state: RequestState) -> None:
        del self.states[state.request_id]
        del self.by_seq[state.seq.seq_id]
        self.on_forget((state.seq.seq_id,))

    def of(self, seqs: Iterable[Sequence]) -> list[RequestState]:
        return [self.by_seq[seq.seq_id] for seq in seqs]

    def take_logprobs(self, states: list[RequestState], result, live: list[bool]) -> None:
        """Hand a step's logprobs (a ModelRunnerOutput's) to their requests, those still `live`
        (the others finished while the step was in flight)."""
        if result.logprobs is not None:
            for state, top, alive in zip(states, result.logprobs, live):
                if top is not None and alive:
                    state.add_logprobs(top)
        for seq_id, (start, tops) in result.prompt_logprobs.items():
            state = self.by_seq.get(seq_id)
            if state is not None:
                state.add_prompt_logprobs(start, tops)

    def advance(self, state: RequestState, t: float) -> RequestOutput | None:
        """Take a request's new token into its text and stop strings; its output, if it has one
        this step (not yet delivered)."""
        seq = state.seq
        if state.on_new_tokens(t):  # a stop string matched
            if seq.is_finished:  # completed by the last allowed token: still a stop, as in vLLM
                seq.finish_reason = FinishReason.STOP
            else:
                self.scheduler.finish(seq, FinishReason.STOP)
        output = state.make_output(t)
        if seq.is_finished:
            self.forget(state)
        return output

    def finish_now(self, state: RequestState, reason: FinishReason, error: str | None = None) -> RequestOutput:
        """End a request outside the normal flow (abort, failure); its final output, not yet
        delivered."""
        self.scheduler.finish(state.seq, reason)
        state.error = error
        t = now()
        try:
            output = state.final_output(t) if error is None else state.make_output(t)
        except Exception:  # noqa: BLE001 - the text is what failed: report the text there is
            output = state.make_output(t)
        self.forget(state)
        return output

    def abort(self, request_id: str) -> list[RequestOutput] | None:
        """Finish a request (every unfinished completion of an n > 1 one) with "abort"; its
        delivered final output, or None when no unfinished request has this id."""
        parent = self.parents.get(request_id)
        if parent is not None:
            # The waiting children first, so that none is left to start on its own.
            live = [child for child in reversed(parent.children) if child.request_id in self.states]
            return self.deliver([self.finish_now(child, FinishReason.ABORT) for child in live][::-1])
        state = self.states.get(request_id)
        return None if state is None else self.deliver([self.finish_now(state, FinishReason.ABORT)])

    def deliver(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Fold the completions of n > 1 requests into one output each and hand every output to
        its consumer (the outbox); return what was delivered."""
        if self.parents:
            outputs = merge_outputs(outputs, self.parents)
        for output in outputs:
            self.outbox.put(output)
        return outputs
