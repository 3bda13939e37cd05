"""The one run-to-completion loop: queue prepared requests and step the engine until they finish.

`LLM.generate` and both benchmarks run through it; what each needs per step (a progress bar,
per-step timings) comes in through `on_step`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fastgen.engine.llm_engine import LLMEngine
from fastgen.engine.request_state import RequestState
from fastgen.outputs import RequestOutput, StepResult


def run_to_completion(engine: LLMEngine, states: Sequence[RequestState],
                      on_step: Callable[[StepResult], None] | None = None) -> list[RequestOutput]:
    """Queue `states` (from `engine.prepare`, so all validated already) as claimed requests and
    step `engine` until each has its final output; return those, in order. Other requests progress
    alongside, and their outputs stay in the engine for their own consumers. `on_step` sees every
    step's result.

    If anything raises (KeyboardInterrupt, `on_step`), the requests still unfinished are aborted,
    so their blocks come back, and the exception propagates.
    """
    ids: list[str] = []
    finals: dict[str, RequestOutput] = {}
    try:
        for state in states:
            ids.append(engine.enqueue(state, claimed=True))
        pending = set(ids)
        while pending:
            result = engine.run_step()
            if on_step is not None:
                on_step(result)
            for output in result.outputs:
                if output.finished and output.request_id in pending:
                    finals[output.request_id] = output
                    pending.discard(output.request_id)
                    engine.release(output.request_id)  # closes its mailbox
            if pending and result.is_prefill is None and not engine.scheduler.has_unfinished():
                raise RuntimeError(f"requests {sorted(pending)} left the engine without a final output")
    except BaseException:
        for request_id in ids:
            engine.release(request_id)
        raise
    return [finals[i] for i in ids]
