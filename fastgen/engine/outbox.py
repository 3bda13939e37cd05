"""Where a request's outputs wait for their consumer, so that whoever drives the engine never
takes (or drops) outputs that belong to someone else.

Two kinds of consumer:
- `step()`'s caller: requests added with `add_request` (an application's own loop, the
  background thread). Their outputs queue in one list, in the order they were made, until
  the next `step()` returns them, whoever made them (a `generate()` or a stream that drove the
  engine meanwhile).
- a claimed request's own reader (`LLM.generate`, `LLM.stream`): each has a mailbox that only its
  reader empties; outputs made after the reader left (closed a stream) are dropped, since
  nobody is there to want them.

`abandon` is the one method any thread may call (a stream's finalizer runs wherever the
garbage collector does): it only appends to a deque, and the engine's thread acts on it.
"""

from __future__ import annotations

from collections import deque

from fastgen.outputs import RequestOutput


class Outbox:
    def __init__(self):
        self.for_step: list[RequestOutput] = []
        self.mailboxes: dict[str, deque[RequestOutput]] = {}
        self.claimed: set[str] = set()  # claimed requests whose final output is not yet put
        # Outputs made outside a step (aborts), which the next step result also reports.
        self.between_steps: list[RequestOutput] = []
        self.abandoned: deque[str] = deque()

    def open(self, request_id: str) -> None:
        """Claim a request: its outputs go to its mailbox, not to step()."""
        self.claimed.add(request_id)
        self.mailboxes[request_id] = deque()

    def put(self, output: RequestOutput) -> None:
        """Hand an output to its consumer: a claimed request's mailbox (dropped when its reader
        has left), else the list `step()` returns."""
        request_id = output.request_id
        if request_id not in self.claimed:
            self.for_step.append(output)
            return
        if output.finished:
            self.claimed.discard(request_id)
        mailbox = self.mailboxes.get(request_id)
        if mailbox is not None:
            mailbox.append(output)

    def take(self, request_id: str) -> RequestOutput | None:
        """A claimed request's next output (None when none waits); the mailbox closes once its
        final output is taken."""
        mailbox = self.mailboxes.get(request_id)
        if not mailbox:
            return None
        output = mailbox.popleft()
        if output.finished:
            del self.mailboxes[request_id]
        return output

    def close(self, request_id: str) -> None:
        """The reader left: drop what waits and whatever comes later."""
        self.mailboxes.pop(request_id, None)

    def final_waits(self, request_id: str) -> bool:
        """Whether a final output of this id (an abort's, or one a `generate()` made while it
        drove the engine) still waits for `step()` to return it."""
        return any(o.finished and o.request_id == request_id for o in self.between_steps) or \
            any(o.finished and o.request_id == request_id for o in self.for_step)

    def take_for_step(self) -> list[RequestOutput]:
        outputs, self.for_step = self.for_step, []
        return outputs

    def take_between_steps(self) -> list[RequestOutput]:
        outputs, self.between_steps = self.between_steps, []
        return outputs

    def abandon(self, request_id: str) -> None:
        """Any thread: the request's reader is gone; the engine releases it on its next call."""
        self.abandoned.append(request_id)

    def take_abandoned(self) -> list[str]:
        ids = []
        while self.abandoned:
            ids.append(self.abandoned.popleft())
        return ids
